"""Write deploy/k8s/monitoring/prometheusrule.yaml from deploy/prometheus/alerts.yml.

Prometheus Operator users get the same rules as a PrometheusRule object; the plain rules file
stays the one source (tests/unit/test_deploy_prometheus.py checks the two are equal).

    .venv/bin/python scripts/gen_prometheusrule.py          # rewrite the PrometheusRule
    .venv/bin/python scripts/gen_prometheusrule.py --check  # exit 1 if it is out of date
"""

from __future__ import annotations

import pathlib
import sys

import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
OUT = ROOT / "deploy" / "k8s" / "monitoring" / "prometheusrule.yaml"

HEADER = """\
# Generated from deploy/prometheus/alerts.yml by scripts/gen_prometheusrule.py: edit that file and
# rerun the script. Prometheus Operator: kubectl apply -k deploy/k8s/monitoring (with the PodMonitor).
# The Prometheus resource must select it (ruleSelector); the label below is the common choice.
"""


def prometheus_rule() -> dict:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "pdmesh", "labels": {"app.kubernetes.io/part-of": "pdmesh", "role": "alert-rules"}},
        "spec": {"groups": groups},
    }


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (PromQL, descriptions) as literal blocks, as in the rules file."""


_Dumper.add_representer(
    str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None))


def render() -> str:
    return HEADER + yaml.dump(prometheus_rule(), Dumper=_Dumper, sort_keys=False, width=110)


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if OUT.read_text() != text:
            print(f"{OUT} is out of date: run scripts/gen_prometheusrule.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
