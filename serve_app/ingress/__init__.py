"""The Ingress deployment: a grpc.aio server inside a Serve replica, with TLS and tokens."""
