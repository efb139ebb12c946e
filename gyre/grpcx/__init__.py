"""gRPC scaffolding shared by every service: servers, channels, error mapping, fencing."""
