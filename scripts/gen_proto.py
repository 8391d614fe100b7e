"""Generate Python gRPC code from proto/ into services/common/generated/.

The proto files are mapped under the virtual path services/common/generated/ so that the
generated modules import each other by their real package path (no sys.path tricks and no
post-editing of generated code).
"""

import pathlib
import shutil
import sys

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_PKG = "services/common/generated"


def main() -> int:
    out = ROOT / OUT_PKG
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    protos = sorted(PROTO_DIR.rglob("*.proto"))
    if not protos:
        print("gen_proto: no .proto files under proto/")
    grpc_include = pathlib.Path(protoc.__file__).parent / "_proto"
    for proto in protos:
        rel = proto.relative_to(PROTO_DIR)
        args = [
            "protoc",
            f"-I{OUT_PKG}={PROTO_DIR}",
            f"-I{grpc_include}",
            f"--python_out={ROOT}",
            f"--pyi_out={ROOT}",
            f"--grpc_python_out={ROOT}",
            f"{OUT_PKG}/{rel.as_posix()}",
        ]
        if protoc.main(args) != 0:
            print(f"gen_proto: protoc failed on {rel}", file=sys.stderr)
            return 1
    # Make every generated directory an importable package.
    for d in [out, *[p for p in out.rglob("*") if p.is_dir()]]:
        (d / "__init__.py").touch()
    print(f"gen_proto: generated {len(protos)} proto file(s) into {OUT_PKG}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
