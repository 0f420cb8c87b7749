#!/usr/bin/env bash
# "Nodes" on one machine for multi-node runs: one network namespace per node (ciera-node0,
# ciera-node1, ...), each with its own address on a bridge (veth pairs; 10.77.0.1, .2, ...;
# the bridge itself is 10.77.0.254 in the root namespace, where mpirun runs), the links between
# nodes shaped with tbf on each node's egress. Ranks of one node share a namespace (and, run
# through bench/netns_rsh.sh, its hostname and /dev/shm), so they use shared memory among
# themselves and TCP to the others. Needs root, ip, tc.
#
#   bench/netns_nodes.sh up N [RATE]   # N nodes; RATE e.g. 1gbit (default: unshaped)
#   bench/netns_nodes.sh down          # removes every ciera-node* namespace and the bridge
#   bench/netns_nodes.sh hostfile N SLOTS   # an Open MPI hostfile for them, on stdout
set -euo pipefail
BR=ciera-br0
case "${1:-}" in
up)
    N=${2:?number of nodes}
    RATE=${3:-}
    "$0" down
    ip link add "$BR" type bridge
    ip link set "$BR" mtu 9000
    ip addr add 10.77.0.254/24 dev "$BR"
    ip link set "$BR" up
    for i in $(seq 0 $((N - 1))); do
        ns=ciera-node$i
        ip netns add "$ns"
        ip link add "cn$i-h" type veth peer name "cn$i-n"
        ip link set "cn$i-h" master "$BR" up
        ip link set "cn$i-n" netns "$ns"
        ip -n "$ns" link set lo up
        ip -n "$ns" addr add "10.77.0.$((i + 1))/24" dev "cn$i-n"
        # Packets as the shaped loopback of bench/shaped_compare.sh carries them: jumbo frames
        # (as cluster links use), no GSO super-packets (tbf drops packets above its burst).
        # With 1500-byte frames this VM's per-packet cost, not the link, bounded 2.5 Gbit/s.
        ip -n "$ns" link set "cn$i-n" mtu 9000
        ip -n "$ns" link set dev "cn$i-n" gso_max_size 9000
        ip link set "cn$i-h" mtu 9000
        ip -n "$ns" link set "cn$i-n" up
        ip -n "$ns" route add default via 10.77.0.254
        # As on a tuned cluster host: a link idle between collectives (a compute phase) keeps
        # its congestion window instead of restarting from slow start at every call.
        ip netns exec "$ns" sysctl -qw net.ipv4.tcp_slow_start_after_idle=0
        if [ -n "$RATE" ]; then
            ip netns exec "$ns" tc qdisc add dev "cn$i-n" root tbf rate "$RATE" burst 64kb latency 10ms
        fi
    done
    # Names for the nodes (mpirun's hostfile, the daemons' hostnames).
    for i in $(seq 0 $((N - 1))); do
        grep -q " ciera-node$i\$" /etc/hosts || echo "10.77.0.$((i + 1)) ciera-node$i" >>/etc/hosts
    done
    echo "nodes ciera-node0..ciera-node$((N - 1)) up${RATE:+, egress shaped to $RATE}"
    ;;
down)
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep '^ciera-node' || true); do
        # Whatever still runs there (a rank of a failed job) goes with it.
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
        ip netns del "$ns"
    done
    ip link del "$BR" 2>/dev/null || true
    for l in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | grep '^cn[0-9]*-h' | cut -d@ -f1); do
        ip link del "$l" 2>/dev/null || true
    done
    sed -i '/ ciera-node[0-9]*$/d' /etc/hosts 2>/dev/null || true
    ;;
hostfile)
    N=${2:?number of nodes}
    SLOTS=${3:-2}
    for i in $(seq 0 $((N - 1))); do echo "ciera-node$i slots=$SLOTS"; done
    ;;
*)
    echo "usage: $0 up N [RATE] | down | hostfile N SLOTS" >&2
    exit 2
    ;;
esac
