"""The protocol-neutral serving core of an ingress replica: checks, admission, dispatch, cache."""
