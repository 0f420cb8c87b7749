#!/bin/sh
# Open MPI's rsh agent for the nodes of bench/netns_nodes.sh (mpirun --mca plm_rsh_agent
# bench/netns_rsh.sh): "ssh HOST COMMAND" becomes COMMAND run in HOST's network namespace, with
# the node's own hostname and its own /dev/shm (else Open MPI's shared-memory segments of
# different nodes collide). The ranks a node's daemon starts inherit all three.
host=$1
shift
exec ip netns exec "$host" unshare --uts --mount sh -c "hostname $host; mount -t tmpfs tmpfs /dev/shm; $*"
