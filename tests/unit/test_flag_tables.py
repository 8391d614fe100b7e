"""The docs' flag tables match services/common/config.py: the generated ones byte for byte
(scripts/gen_flag_tables.py), and every flag and default README's tables name."""

from __future__ import annotations

import re
import runpy

from services.common.config import DECODE_FLAGS, PREFILL_FLAGS, ROUTER_FLAGS

GEN = runpy.run_path("scripts/gen_flag_tables.py", run_name="gen_flag_tables")
ROLE_FLAGS = {"router": ROUTER_FLAGS, "prefill": PREFILL_FLAGS, "decode": DECODE_FLAGS}


def test_generated_tables_are_current():
    stale = [str(p) for p, text in GEN["outputs"]().items() if not p.exists() or p.read_text(encoding="utf-8") != text]
    assert not stale, f"run `python scripts/gen_flag_tables.py`: {stale} differ from services/common/config.py"


UNITS = {"s": 1, "ms": 1e-3, "KiB": 1024, "MiB": 1 << 20, "GiB": 1 << 30}


def _value(text: str):
    text = text.strip()
    first = text.split(" (")[0].strip()
    if first in ("on", "off"):
        return first == "on"
    m = re.match(r"^([0-9][0-9,.]*)\s*([A-Za-z]*)", first)
    assert m, f"README default {text!r} is neither on/off nor a number with a unit"
    number = float(m.group(1).replace(",", ""))
    return number * UNITS.get(m.group(2), 1)


def _same(default, value) -> bool:
    if isinstance(default, bool) or isinstance(value, bool):
        return bool(default) == bool(value)
    return abs(float(default) - float(value)) < 1e-9


def test_readme_tables_name_real_flags_with_their_defaults():
    rows = [line for line in open("README.md", encoding="utf-8") if re.match(r"^\| `--", line)]
    assert rows
    for row in rows:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        names = re.findall(r"`--([a-z0-9-]+)`", cells[0])
        where = re.search(r"\((router|prefill|decode|both(?: workers)?)\)", cells[0])
        roles = ["prefill", "decode"] if where is None or where.group(1).startswith("both") else [where.group(1)]
        defaults = [d for d in re.split(r",\s(?![^()]*\))", cells[1])]
        assert len(defaults) == len(names), f"README row {cells[0]}: {len(names)} flags, defaults {cells[1]!r}"
        for name, shown in zip(names, defaults, strict=True):
            for role in roles:
                flag = next((f for f in ROLE_FLAGS[role] if f.name == name), None)
                assert flag is not None, f"README names --{name} for {role}, which has no such flag"
                assert _same(flag.default, _value(shown)), f"README: --{name} default {shown!r}, config {flag.default!r}"
