#!/usr/bin/env bash
# appliance/provision.sh - provision an hpclb gateway, backend node or client.
#
# Idempotent: a second run changes nothing and says so ("provision: no
# change"). --check prints what would change and changes nothing. --root DIR
# provisions a directory tree (an image, a test) instead of /: nothing is done
# to the running system there (no packages, no build, no sysctl -w, no unit
# started), and each skipped step says so.
#
# Steps: (1) the role's Debian packages (only the missing ones); (2) this
# source tree copied into ROOT/opt/hpclb (checksums: an unchanged file is not
# copied again); (3) the build there: .venv with hpclb installed, and for the
# gateway the data planes (make -C dataplane), each skipped when up to date;
# (4) python -m hpclb.provision ROLE for everything else (user, directories,
# configuration, keys, hugepages, sysctls, NIC binding, units): see
# control/hpclb/provision/. Exit 0 done, 1 error, 2 usage, 3 refused (nothing
# changed).
set -euo pipefail

SRC=$(cd "$(dirname "$(readlink -f "$0")")/.." && pwd)
PROG=provision.sh

usage() {
  cat <<EOF
usage: $PROG [--role gateway|node|client] [--root DIR] [--check] [--config EXAMPLE]
             [--dataplane xdp|dpdk|auto] [--ingress IF] [--egress IF[,IF]]
             [--management IF] [--management-address A] [--hugepages-mb N]
             [--keys-dir DIR] [--gateway ADDR] [--name NAME] [--sysfs DIR] [--host-facts]

  --role ROLE            gateway (default): the appliance; node: a backend running
                         hpclb-agent; client: a load client
  --root DIR             provision the tree DIR instead of / (nothing live is done)
  --check                print what would change, change nothing
  --config EXAMPLE       the configuration example (gateway default:
                         appliance/examples/gateway.yaml; required for node, client)
  --dataplane MODE       xdp, dpdk or auto, written into the configuration
  --ingress IF           ingress data interface
  --egress IF[,IF]       egress data interfaces
  --management IF        the management NIC (never a data port, never bound)
  --management-address A the appliance's own address for its services
  --hugepages-mb N       DPDK hugepages to reserve (dataplane dpdk)
  --keys-dir DIR         where gateway and nodes exchange public CURVE keys
  --gateway ADDR         node/client: the appliance's address
  --name NAME            appliance or node name (default: the host name)
  --sysfs DIR            read host facts from DIR instead of /sys (tests)
  --host-facts           with --root: this host's facts (its NICs, CPUs) stand for the
                         target's (by default --root reads no host facts)
EOF
}

role=gateway root=/ check=0
py_args=()
gateway_only=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --check) check=1; py_args+=(--check); shift; continue ;;
    --host-facts) py_args+=(--host-facts); gateway_only+=("$1"); shift; continue ;;
  esac
  [ $# -ge 2 ] || { echo "$PROG: $1 needs a value (see -h)" >&2; exit 2; }
  case "$1" in
    --role) role=$2 ;;
    --root) root=$2 ;;
    --config|--keys-dir|--name) py_args+=("$1" "$2") ;;
    --gateway) py_args+=("$1" "$2"); gw_flag=1 ;;
    --dataplane|--ingress|--egress|--management|--management-address|--hugepages-mb|--sysfs)
      py_args+=("$1" "$2"); gateway_only+=("$1") ;;
    *) echo "$PROG: unknown option $1 (see -h)" >&2; exit 2 ;;
  esac
  shift 2
done

case "$role" in
  gateway|node|client) ;;
  *) echo "$PROG: --role must be gateway, node or client, not $role" >&2; exit 2 ;;
esac
if [ "$role" != gateway ] && [ ${#gateway_only[@]} -gt 0 ]; then
  echo "$PROG: ${gateway_only[*]}: gateway options, not for --role $role" >&2; exit 2
fi
if [ "$role" = gateway ] && [ -n "${gw_flag:-}" ]; then
  echo "$PROG: --gateway is for --role node or client" >&2; exit 2
fi
if [ "$root" != / ]; then
  [ -d "$root" ] || { echo "$PROG: --root $root: no such directory" >&2; exit 2; }
  root=$(cd "$root" && pwd)
fi
live=0
[ "$root" = / ] && live=1
if [ "$check" = 0 ] && [ "$(id -u)" != 0 ]; then
  echo "$PROG: run as root (or with --check to see what would change)" >&2; exit 2
fi

changes=0
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# One report line per step, in the format of the Python steps.
changed() {
  if [ "$check" = 1 ]; then echo "would change: $*"; else echo "changed: $*"; fi
  changes=$((changes + 1))
}

# The Python that runs the plan: the installed tree's once built (live), else
# this tree's .venv (an image or a test built from a checkout); empty if none.
python_env() {
  if [ "$live" = 1 ] && [ -x "$dest/.venv/bin/python" ]; then
    echo "$dest/.venv/bin/python"
  elif [ -x "$SRC/.venv/bin/python" ]; then
    echo "$SRC/.venv/bin/python"
  fi
}
plan() {
  local py=$1; shift
  PYTHONPATH="$SRC/control${PYTHONPATH:+:$PYTHONPATH}" \
    "$py" -m hpclb.provision "$role" --root "$root" --src "$SRC" "$@"
}

# The whole plan is checked before the first change, so that a broken example
# or a refused NIC changes nothing at all (not even the tree in /opt/hpclb).
# Possible when a Python environment exists already; on a bare host the plan
# is checked after the build, before any change of its own.
dest="${root%/}/opt/hpclb"
py=$(python_env)
if [ -n "$py" ] && [ "$check" = 0 ]; then
  plan "$py" --check "${py_args[@]}" >/dev/null || exit $?
fi

# ---------------------------------------------------------------- (1) packages
common_pkgs=(python3 python3-venv iproute2 procps rsync systemd)
case "$role" in
  gateway) pkgs=("${common_pkgs[@]}"
                 # the data planes' build and run time (as ./bootstrap, minus the lab's tools)
                 build-essential pkg-config clang llvm libbpf-dev bpftool libelf-dev
                 zlib1g-dev libzmq3-dev libmsgpack-dev python3-dev
                 dpdk dpdk-dev libdpdk-dev meson ninja-build pciutils
                 librte-net-af-xdp23 librte-net-af-packet23 librte-net-tap23
                 # PCI poll-mode drivers for NICs bound to vfio-pci (dpdk only
                 # recommends them), its default mempool, and modprobe
                 librte-net-virtio23 librte-net-e1000-23 librte-net-ixgbe23 librte-net-i40e23
                 librte-net-ice23 librte-net-mlx5-23 librte-net-vmxnet3-23 librte-mempool-ring23
                 kmod ethtool iputils-ping
                 # the BGP speaker (hpclb-bird.service), used when the configuration has bgp:
                 bird2
                 # VRRP for an active/standby pair (hpclb-keepalived.service), with vrrp:
                 keepalived) ;;
  node) pkgs=("${common_pkgs[@]}") ;;
  client) pkgs=("${common_pkgs[@]}" iputils-ping curl netsniff-ng tcpdump) ;;
esac
if [ "$live" = 0 ]; then
  echo "skipped (--root): packages (dpkg and apt act on the running system)"
else
  missing=()
  for pkg in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" \
      || missing+=("$pkg")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    if [ "$check" = 0 ]; then
      export DEBIAN_FRONTEND=noninteractive
      apt-get update -qq
      apt-get install -y -qq --no-install-recommends "${missing[@]}"
    fi
    changed "packages: install ${missing[*]}"
  fi
fi

# ---------------------------------------------------------------- (2) the tree
if [ "$(readlink -f "$SRC")" = "$(readlink -m "$dest")" ]; then
  echo "tree: running from $dest itself, nothing to copy"
else
  # The files git tracks (and new ones it does not ignore); without git, the
  # tree minus virtual environments and build outputs. Never --delete: the
  # venv and build under /opt/hpclb are the appliance's own. Owned by root
  # (no -o/-g: a synced folder's owner is not carried over), writable by root only.
  rsync_args=(-rlpt --chmod=go-w --checksum --itemize-changes)
  if [ "$check" = 1 ]; then
    rsync_args+=(--dry-run)
  else
    install -d -m 0755 "${root%/}/opt" "$dest"
  fi
  if git -C "$SRC" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    list=$work/files
    git -C "$SRC" ls-files -z --cached --others --exclude-standard >"$list"
    # A file deleted in the work tree but still tracked is not copied, nor a
    # virtual environment git was not told to ignore (a .venv symlink).
    # shellcheck disable=SC2016  # the inner sh expands $f, not this one
    items=$(cd "$SRC" && xargs -0 -r sh -c 'for f; do case $f in .venv*) continue ;; esac
              [ -e "$f" ] && printf "%s\0" "$f"; done' sh \
              <"$list" | rsync "${rsync_args[@]}" --from0 --files-from=- . "$dest/")
  else
    # Not Vagrant's state nor its key exchange (secret keys: they go to
    # /etc/hpclb/curve through --keys-dir, never a second copy in the tree).
    items=$(rsync "${rsync_args[@]}" --exclude='.venv*' --exclude=.git \
              --exclude=.vagrant --exclude=.hpclb-keys \
              --exclude=dataplane/build --exclude=__pycache__ --exclude='*.egg-info' \
              --exclude=control/hpclb/_installed.json "$SRC/" "$dest/")
  fi
  # A directory whose only change is its time is not a change of the tree.
  n=$(printf '%s\n' "$items" | grep -cv -e '^$' -e '^\.d\.\.t' || true)
  if [ "$n" -gt 0 ]; then
    changed "tree: $dest ($n paths copied or updated)"
  fi
fi

# ---------------------------------------------------------------- (3) build
if [ "$live" = 0 ]; then
  echo "skipped (--root): build (the venv and the data planes are built on the host itself)"
else
  venv=$dest/.venv stamp=$dest/.venv/.hpclb-installed
  if [ ! -x "$venv/bin/python" ] || [ ! -f "$stamp" ] || [ "$dest/pyproject.toml" -nt "$stamp" ]; then
    if [ "$check" = 0 ]; then
      [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
      "$venv/bin/pip" install -q --upgrade pip
      "$venv/bin/pip" install -q -e "$dest"
      touch "$stamp"
    fi
    changed "build: $venv (hpclb and its Python dependencies)"
  fi
  if [ "$role" = gateway ]; then
    # make decides what to rebuild (its phony steps, ninja and the manifest,
    # make `make -q` useless); a change is an output newer than before.
    if [ "$check" = 1 ]; then
      [ -f "$dest/control/hpclb/_installed.json" ] \
        || changed "build: the data planes (make -C $dest/dataplane)"
    else
      touch "$work/mark"
      make -s -C "$dest/dataplane"
      n=$(find "$dest/dataplane/build" "$dest/control/hpclb/_installed.json" -type f \
            -newer "$work/mark" -not -name '.ninja_*' 2>/dev/null | wc -l)
      [ "$n" -eq 0 ] || changed "build: the data planes (make -C $dest/dataplane: $n files)"
    fi
  fi
fi

# ---------------------------------------------------------------- (4) the rest
py=$(python_env)
if [ -z "$py" ]; then
  if [ "$check" = 1 ]; then
    echo "provision: no Python environment yet (the build makes it): the rest cannot be checked"
    exit 0
  fi
  echo "$PROG: no Python environment at $dest/.venv or $SRC/.venv (run ./bootstrap in $SRC)" >&2
  exit 1
fi
plan "$py" --prior-changes "$changes" "${py_args[@]}"
