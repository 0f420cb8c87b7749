# Sourced by the bench scripts: a network namespace whose loopback is shaped with tbf (the
# kernel has tbf, not netem), so that ranks on one machine talk TCP over a link of RATE.
# Needs root (ip netns, tc).
#
#   . bench/shaped_lo.sh
#   shaped_lo_up NS 1gbit     # then: ip netns exec NS ...
#   shaped_lo_up NS           # the same loopback, unshaped
#   shaped_lo_down NS

shaped_lo_up() {
    local ns=$1 rate=${2:-}
    ip netns add "$ns"
    ip netns exec "$ns" ip link set lo up
    # Packets as a real link carries them: jumbo frames, no 64-512 KiB GSO super-packets (with
    # those, tbf lets long streams run several percent above the rate, flattering bulk raw
    # sends).
    ip netns exec "$ns" ip link set lo mtu 9000
    ip netns exec "$ns" ip link set dev lo gso_max_size 9000
    # burst: a few packets' worth (tbf drops packets larger than the burst); latency bounds the
    # queue (10 ms).
    if [ -n "$rate" ]; then
        ip netns exec "$ns" tc qdisc add dev lo root tbf rate "$rate" burst 64kb latency 10ms
    fi
}

shaped_lo_down() {
    ip netns del "$1" 2>/dev/null || true
}
