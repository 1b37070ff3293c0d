"""The ``sdcguard`` operator command line."""
