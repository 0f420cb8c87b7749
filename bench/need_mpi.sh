# Sourced by the bench scripts: install Open MPI from Debian where mpicc or mpirun is missing.
if ! command -v mpicc >/dev/null || ! command -v mpirun >/dev/null; then
    echo "# mpicc/mpirun missing: installing Open MPI from Debian" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2
    apt-get install -y -qq openmpi-bin libopenmpi-dev >&2
fi
