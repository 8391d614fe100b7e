"""Build the compose image ahead of its tests: `python -m services.launch.prebuild_image
[--override FILE]... [--log-dir DIR]`.

`make test` runs this in the background while the main suite runs, so the container tests
that follow find every layer cached instead of spending their first minutes building (the
build mostly unpacks and installs wheels, which the suite's two busy cores leave room for).
The build is the one `Compose.start()` does (same engine, compose files and format), so a
failure here changes nothing: the container tests build again and report it themselves.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time

from services.launch.compose import Compose, NoEngine, prepare_wheelhouse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--override", action="append", default=[], type=pathlib.Path,
                        help="a compose file added after the CPU override (as the tests add theirs)")
    parser.add_argument("--log-dir", type=pathlib.Path, default=None,
                        help="where compose.log goes (default: a new temporary folder)")
    args = parser.parse_args(argv)
    log_dir = args.log_dir or pathlib.Path(tempfile.mkdtemp(prefix="pdmesh-prebuild-"))
    try:
        stack = Compose.found(dict(os.environ), log_dir, overrides=tuple(args.override))
    except NoEngine as e:
        print(f"prebuild_image: no image built: {e}")
        return 0
    t = time.monotonic()
    print(f"prebuild_image: {' '.join(stack.compose)} ({stack.engine}); {prepare_wheelhouse()}", flush=True)
    stack.build()
    print(f"prebuild_image: built in {time.monotonic() - t:.1f}s (log: {log_dir / 'compose.log'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
