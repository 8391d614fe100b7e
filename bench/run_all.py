"""`make bench`: run every benchmark in bench/, save each JSON result under bench/out/."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
BENCHES = ["engine.py", "kv_transfer.py", "watchdog.py", "router_overhead.py", "migration.py", "pd_vs_colocated.py"]


def main() -> int:
    out_dir = HERE / "out"
    out_dir.mkdir(exist_ok=True)
    failed = []
    for name in BENCHES:
        path = HERE / name
        if not path.exists():
            continue
        t0 = time.monotonic()
        print(f"[bench] {name} ...", flush=True)
        proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, cwd=HERE.parent)
        target = out_dir / (path.stem + ".json")
        target.write_text(proc.stdout)
        status = "ok" if proc.returncode == 0 else f"FAILED ({proc.returncode})"
        print(f"[bench] {name}: {status} in {time.monotonic() - t0:.0f}s -> {target.relative_to(HERE.parent)}", flush=True)
        if proc.returncode != 0:
            failed.append(name)
            sys.stderr.write(proc.stderr[-3000:])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
