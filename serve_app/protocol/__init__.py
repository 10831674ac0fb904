"""The gRPC services over the serving core: raystream.v1 and the Open Inference Protocol."""
