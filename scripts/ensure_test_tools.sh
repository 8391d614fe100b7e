#!/usr/bin/env bash
# Install the Debian packages the deploy and hosts tests need, when they are missing:
#   prometheus      -> prometheus, promtool   (tests/*/test_deploy_prometheus*.py)
#   docker-compose  -> docker-compose         (tests/unit/test_deploy_compose.py; validates offline)
#   nftables        -> nft                    (tests/hosts: partitions between network namespaces)
#   iproute2        -> ip, tc                 (tests/hosts: the namespaces, their links and rate caps)
#   nginx-light     -> nginx                  (tests/unit/test_router_behind_nginx.py: a reverse proxy in front)
#   openssl         -> openssl                (tests/integration/test_router_tls.py: certificates for HTTPS)
# Quiet and idempotent; never fails the build. Without root or apt-get it only says what is
# missing, and the tests that need it skip with a message naming the package.
# Set PDMESH_SKIP_TOOL_INSTALL=1 to never touch apt.

set -u

missing=()
{ command -v prometheus && command -v promtool; } >/dev/null 2>&1 || missing+=(prometheus)
command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
command -v nft >/dev/null 2>&1 || missing+=(nftables)
{ command -v ip && command -v tc; } >/dev/null 2>&1 || missing+=(iproute2)
command -v nginx >/dev/null 2>&1 || missing+=(nginx-light)
command -v openssl >/dev/null 2>&1 || missing+=(openssl)
[ ${#missing[@]} -eq 0 ] && exit 0

say() { echo "ensure_test_tools: $*" >&2; }

if [ "${PDMESH_SKIP_TOOL_INSTALL:-0}" = 1 ]; then
    say "missing apt package(s) ${missing[*]}; PDMESH_SKIP_TOOL_INSTALL=1, so their tests will skip"
    exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    say "missing apt package(s) ${missing[*]} (need root and apt-get to install); their tests will skip"
    exit 0
fi

log="$(mktemp -t ensure_test_tools.XXXXXX.log)"
export DEBIAN_FRONTEND=noninteractive
apt_opts=(-y -qq --no-install-recommends -o DPkg::Lock::Timeout=120)

# Packages must not start daemons here (Debian's prometheus would start one on :9090 where an
# init system runs): a policy-rc.d that forbids it, only if none exists, removed afterwards.
policy=/usr/sbin/policy-rc.d
own_policy=0
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && own_policy=1
fi

install() { timeout 900 apt-get install "${apt_opts[@]}" "${missing[@]}" >>"$log" 2>&1; }
ok=0
if install; then
    ok=1
elif timeout 300 apt-get update -qq >>"$log" 2>&1 && install; then
    ok=1
fi

[ "$own_policy" = 1 ] && rm -f "$policy"

if [ "$ok" = 1 ]; then
    say "installed ${missing[*]}"
    rm -f "$log"
else
    say "could not install ${missing[*]} (log: $log); their tests will skip"
fi
exit 0
