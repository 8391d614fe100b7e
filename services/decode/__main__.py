import os

# gRPC's C core logs to stderr in its own format; keep it to errors (our logs are JSON).
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from services.common.config import parse_command_line  # noqa: E402

parse_command_line("decode")  # --help and a bad flag are answered before the heavy imports below

from services.decode.main import main  # noqa: E402

main()
