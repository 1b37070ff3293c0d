"""The local stand-in for AWS (moto with extensions) and the EKS API, used by the drill and the tests."""
