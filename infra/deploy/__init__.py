"""Deployment: the CloudFormation template, the RBAC manifest, the Lambda package, deploy and destroy."""
