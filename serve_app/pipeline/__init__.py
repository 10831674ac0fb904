"""The route: which deployments run which stages, and the stage deployments' autoscaling."""
