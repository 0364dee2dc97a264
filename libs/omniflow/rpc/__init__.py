"""The gRPC runtime every service shares: server bootstrap, channels, interceptors."""
