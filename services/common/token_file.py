"""`python -m services.common.token_file PATH`: make the internal token file if it is missing.

Compose runs it once before the services start (deploy/docker-compose.yml, service
`internal-token`): a fresh secret of 32 random bytes, hex, in a volume that only the pdmesh
services mount, readable by the pdmesh user and no one else. An existing non-empty file is kept,
so restarts keep the token; removing the volume makes a new one.
"""

from __future__ import annotations

import os
import pathlib
import secrets
import sys

PDMESH_UID = 10001  # the image's pdmesh user (deploy/Dockerfile)


def ensure_token_file(path: pathlib.Path, uid: int = PDMESH_UID) -> bool:
    """Write a new token at `path` unless one is there; returns whether it wrote one."""
    if path.is_file() and path.read_text().strip():
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o400)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    if os.geteuid() == 0:
        os.chown(tmp, uid, uid)
    os.replace(tmp, path)
    return True


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m services.common.token_file PATH", file=sys.stderr)
        return 2
    wrote = ensure_token_file(pathlib.Path(argv[0]))
    print(f"internal token {'written to' if wrote else 'kept at'} {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
