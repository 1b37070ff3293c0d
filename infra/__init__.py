"""Deployment and the local stand-in for AWS and the EKS API."""
