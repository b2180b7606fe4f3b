"""Limits both ends of a gRPC connection must agree on (a contract: no server code imported here,
so the SDK can depend on it alone).

gRPC refuses messages over 4 MB unless both ends raise the limit; embedding blobs of large images
exceed that, so servers (shared/settings.py) and clients (shared/sdk) share this default.
"""

DEFAULT_GRPC_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
