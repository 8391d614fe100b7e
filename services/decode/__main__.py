import os

# gRPC's C core logs to stderr in its own format; keep it to errors (our logs are JSON).
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from services.decode.main import main  # noqa: E402

main()
