#!/usr/bin/env bash
# appliance/dpdk-host-setup.sh - prepare a gateway host for hpclb's DPDK forwarder.
#
#   appliance/dpdk-host-setup.sh [--hugepages-mb 1024] [--bind 0000:3b:00.0 ...]
#
# Reserves 2 MB hugepages on every NUMA node (early in boot memory is least
# fragmented: run it from a oneshot unit before hpclb.service, or put
# vm.nr_hugepages in /etc/sysctl.d), loads vfio-pci and binds the given NICs to
# it with DPDK's own dpdk-devbind.py. Without --bind, the ports stay kernel
# interfaces and hpclb uses a vdev on them (dpdk.driver: af_xdp or af_packet)
# or, with dataplane: auto, falls back to XDP. Idempotent.
set -euo pipefail

mb=1024
bind=()
while [ $# -gt 0 ]; do
  case "$1" in
    --hugepages-mb) mb=$2; shift 2 ;;
    --bind) shift; while [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; do bind+=("$1"); shift; done ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "dpdk-host-setup: unknown argument $1" >&2; exit 2 ;;
  esac
done

nodes=(/sys/devices/system/node/node[0-9]*)
[ -e "${nodes[0]}" ] || nodes=(/sys/kernel/mm)  # no NUMA: the global pool
per_node=$(( (mb / 2 + ${#nodes[@]} - 1) / ${#nodes[@]} ))
for node in "${nodes[@]}"; do
  f=$node/hugepages/hugepages-2048kB/nr_hugepages
  [ "$node" = /sys/kernel/mm ] && f=/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages
  have=$(cat "$f")
  if [ "$have" -lt "$per_node" ]; then
    echo "$per_node" > "$f"
  fi
  echo "$(basename "$node"): $(cat "$f") hugepages of 2 MB (asked $per_node)"
done

if [ ${#bind[@]} -gt 0 ]; then
  modprobe vfio-pci
  for dev in "${bind[@]}"; do
    dpdk-devbind.py --bind=vfio-pci "$dev"
  done
  dpdk-devbind.py --status-dev net
fi
