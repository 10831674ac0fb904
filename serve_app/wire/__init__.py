"""What the bytes look like: each protocol's answer, a request's image spans, client pixels."""
