#!/usr/bin/env bash
# The RDMA tests for real, on a soft-RoCE device, on a machine that has no RDMA hardware, no
# rdma_rxe module and no KVM: a QEMU guest in software emulation (-accel tcg -cpu max) boots
# Debian's stock 6.1 kernel (its package ships rdma_rxe; unpacked with dpkg -x, not installed)
# with a small initramfs holding busybox, the modules, the `rdma` tool, libibverbs with its rxe
# provider, the test binaries built here with `--features rdma`, the ciera CLI and the trace
# slice. Inside, `rdma link add rxe0 type rxe netdev lo` makes one soft-RoCE device that every
# rank shares, and the tests run with CIERA_REQUIRE_RDMA=1 (no device is a failure, not a
# skip). The console is printed; one summary line per test binary and a final verdict follow.
# Exit status: 0 when every test binary passed, 1 otherwise (also when the guest hangs: the
# boot is bounded by RXE_GUEST_TIMEOUT seconds, default 1500).
#
# About 100 Mbit/s between ranks in the guest: this proves correctness, not speed.
#
# usage: bench/rxe_guest.sh            build (cargo, --features rdma), boot, run, report
# Environment: RXE_GUEST_DIR (work folder, default target/rxe-guest), RXE_GUEST_TIMEOUT,
# RXE_GUEST_FILTER (passed to both test binaries as a name filter).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
work=${RXE_GUEST_DIR:-$repo/target/rxe-guest}
limit=${RXE_GUEST_TIMEOUT:-1500}
filter=${RXE_GUEST_FILTER:-}
started=$(date +%s)
mkdir -p "$work"

say() { printf 'rxe_guest: %s\n' "$*"; }

# --- packages: QEMU, busybox, cpio, the rxe provider and `rdma`, and what the build needs.
need=()
command -v qemu-system-x86_64 >/dev/null 2>&1 || need+=(qemu-system-x86)
[ -x /bin/busybox ] && /bin/busybox --list 2>/dev/null | grep -qx insmod || need+=(busybox-static)
command -v cpio >/dev/null 2>&1 || need+=(cpio)
[ -f /etc/libibverbs.d/rxe.driver ] || need+=(ibverbs-providers)
command -v rdma >/dev/null 2>&1 || need+=(iproute2)
command -v cmake >/dev/null 2>&1 || need+=(cmake)
[ -f /usr/include/infiniband/verbs.h ] || need+=(libibverbs-dev)
# bindgen loads libclang.so itself (libclang-cpp, which llvm-N-dev brings, is another library).
ls /usr/lib/llvm-*/lib/libclang.so* >/dev/null 2>&1 || need+=(libclang-dev)
if [ ${#need[@]} -gt 0 ]; then
    say "installing ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
busybox=/bin/busybox

# --- the kernel: Debian's newest linux-image-6.1.0-N-amd64, unpacked.
kdir=$work/kernel
if ! ls "$kdir"/boot/vmlinuz-* >/dev/null 2>&1; then
    pkg=$(apt-cache search --names-only '^linux-image-6\.1\.0-[0-9]+-amd64$' | awk '{print $1}' |
        sort -V | tail -1)
    if [ -z "$pkg" ]; then
        say "no linux-image-6.1.0-*-amd64 package in the apt sources (run apt-get update?)"
        exit 1
    fi
    say "downloading $pkg"
    rm -rf "$kdir" "$work"/deb && mkdir -p "$work"/deb
    (cd "$work"/deb && apt-get download "$pkg" 2>&1 | grep -v '^W: Download is performed unsandboxed' || true)
    dpkg -x "$work"/deb/*.deb "$kdir"
fi
vmlinuz=$(ls "$kdir"/boot/vmlinuz-* | head -1)
kver=${vmlinuz##*/vmlinuz-}
modules=(crc32_generic veth ib_core ib_uverbs udp_tunnel ip6_udp_tunnel rdma_rxe)

# --- the binaries: both RDMA test targets and the CLI, built with the feature.
say "building the RDMA tests (cargo, --features rdma)"
json=$work/build.json
cargo test --features rdma -j "${CARGO_BUILD_JOBS:-2}" --no-run --message-format=json \
    -p ciera -p ciera-transport --test rdma >"$json"
mapfile -t tests < <(python3 - "$json" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["executable"])
EOF
)
ciera_bin=$(python3 - "$json" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if (m.get("reason") == "compiler-artifact" and m.get("executable")
            and m["target"]["name"] == "ciera" and "bin" in m["target"]["kind"]):
        print(m["executable"])
EOF
)
if [ ${#tests[@]} -ne 2 ] || [ -z "$ciera_bin" ]; then
    say "expected two RDMA test binaries and the ciera CLI, got: ${tests[*]} / $ciera_bin"
    exit 1
fi

# --- the initramfs. Binaries keep their absolute paths: the tests find the CLI and the trace
# slice at the paths compiled into them.
root=$work/root
rm -rf "$root"
mkdir -p "$root"/{bin,sbin,dev,proc,sys,tmp,etc,modules,run,lib64}
cp "$busybox" "$root"/bin/busybox
for tool in $("$busybox" --list); do
    [ -e "$root/bin/$tool" ] || ln -s busybox "$root/bin/$tool"
done
for m in "${modules[@]}"; do
    f=$(find "$kdir/lib/modules/$kver" -name "$m.ko*" | head -1)
    [ -n "$f" ] || { say "module $m not in the kernel package"; exit 1; }
    case $f in
        *.xz) xz -dc "$f" >"$root/modules/$m.ko" ;;
        *.zst) zstd -qdc "$f" >"$root/modules/$m.ko" ;;
        *) cp "$f" "$root/modules/$m.ko" ;;
    esac
done
copy() { # copy a file to the same path under $root
    mkdir -p "$root$(dirname "$1")"
    cp -L "$1" "$root$1"
}
provider=$(ls /usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav*.so | head -1)
rdma_tool=$(command -v rdma)
copy /etc/libibverbs.d/rxe.driver
copy "$provider"
copy "$rdma_tool"
for t in "${tests[@]}" "$ciera_bin"; do
    mkdir -p "$root$(dirname "$t")"
    strip --strip-debug -o "$root$t" "$t"
done
for lib in $( (ldd "${tests[@]}" "$ciera_bin" "$rdma_tool" "$provider" \
    /usr/lib/x86_64-linux-gnu/libibverbs.so.1 || true) |
    awk '/=> \//{print $3} /^[ \t]+\//{print $1}' | sort -u); do
    copy "$lib"
done
mkdir -p "$root$repo/tests/data"
cp -r "$repo/tests/data/olmoe-slice" "$root$repo/tests/data/"

cat >"$root/init" <<EOF
#!/bin/sh
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mkdir -p /dev/shm /dev/pts
mount -t tmpfs tmp /dev/shm
# /tmp stays the initramfs' own (writable RAM already): a tmpfs over it would hide the test
# binaries and data of a checkout under /tmp, which the image holds at their absolute paths.
hostname rxe-guest
ip link set lo up
echo "RXE-GUEST: booted \$(uname -r) in \$(cut -d' ' -f1 /proc/uptime) s, \$(nproc) CPU(s)"
for m in ${modules[*]}; do
    insmod /modules/\$m.ko || echo "RXE-GUEST: insmod \$m failed"
done
rdma link add rxe0 type rxe netdev lo || echo "RXE-GUEST: rdma link add failed"
rdma link show
export HOME=/tmp TMPDIR=/tmp CIERA_REQUIRE_RDMA=1 CIERA_IB_HCA=rxe0 RUST_BACKTRACE=1
ok=0
for t in ${tests[*]}; do
    echo "RXE-GUEST: running \$t"
    start=\$(cut -d' ' -f1 /proc/uptime)
    timeout 900 \$t --test-threads=1 $filter 2>&1
    rc=\$?
    end=\$(cut -d' ' -f1 /proc/uptime)
    echo "RXE-GUEST: result \$t rc=\$rc (\$start s -> \$end s)"
done
echo "RXE-GUEST: done"
poweroff -f
EOF
chmod +x "$root/init"
initrd=$work/initrd.cpio.gz
(cd "$root" && find . | cpio -o -H newc --quiet | gzip -1 >"$initrd")
say "initramfs $(du -h "$initrd" | cut -f1), kernel $kver; booting (TCG, no KVM)"

# --- boot. -no-reboot and poweroff -f end QEMU; timeout bounds a hung guest.
log=$work/console.log
set +e
timeout --foreground -k 10 "$limit" qemu-system-x86_64 -accel tcg -cpu max -smp 2 -m 2G \
    -nographic -no-reboot -nodefaults -serial stdio -display none \
    -kernel "$vmlinuz" -initrd "$initrd" \
    -append "console=ttyS0 panic=-1 quiet loglevel=3 rdinit=/init" </dev/null | tee "$log"
qrc=${PIPESTATUS[0]}
set -e
elapsed=$(($(date +%s) - started))

# --- verdict.
echo
say "---- summary ($elapsed s including the build; QEMU exit $qrc) ----"
fail=0
for t in "${tests[@]}"; do
    line=$(grep -a "RXE-GUEST: result $t " "$log" | tail -1 || true)
    if [ -z "$line" ]; then
        say "FAIL $(basename "$t"): no result (guest hung, crashed or timed out after ${limit}s)"
        fail=1
    elif [[ $line == *" rc=0 "* ]]; then
        say "PASS $(basename "$t")"
    else
        say "FAIL $(basename "$t"): ${line#RXE-GUEST: result }"
        fail=1
    fi
done
grep -ao -E "^test result:.*|^test .* \.\.\. .*|RXE-GUEST: booted.*" "$log" | sed 's/^/rxe_guest:   /' || true
if grep -aq "RXE-GUEST: done" "$log" && [ $fail -eq 0 ]; then
    say "all RDMA tests passed on soft-RoCE"
    exit 0
fi
say "RDMA tests FAILED (console: $log)"
exit 1
