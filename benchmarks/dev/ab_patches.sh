#!/usr/bin/env bash
# benchmarks/dev/ab_patches.sh -- time prepared header patches (benchmarks/dev/*.patch) in a network's generated
# kernel against the installed headers, in one process, without rebuilding the library:
#
#   bash benchmarks/dev/ab_patches.sh cnn32_24_48_96,smallcnn_bn a=first.patch b=first.patch,second.patch
#   AB_DRY_RUN=1 bash benchmarks/dev/ab_patches.sh ...     # make the copies, print the command, run nothing
#
# Each NAME=PATCH[,PATCH...] becomes build/ab/NAME/cpp: a copy of cpp/ with the patches applied in order (git apply
# --directory; a patch that does not apply stops the script).  Then benchmarks/fused_net_phases.py NET --headers
# build/ab/NAME/cpp ... times every variant in turn and checks each one's outputs against the library's
# interpreter.  Only headers that the generated source includes count (fused_net_gen.headers); a patch to
# cydnn.h is refused there.  After a build of the library (python3 -m pip install --no-build-isolation -e .).
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ $# -lt 2 ]; then
    echo "usage: $0 NETWORK[,NETWORK...] NAME=PATCH[,PATCH...] [...]" >&2
    exit 2
fi
net=$1
shift
args=()
for spec in "$@"; do
    name=${spec%%=*}
    patches=${spec#*=}
    if [ "$name" = "$spec" ] || [ -z "$name" ] || [ -z "$patches" ] || [[ ! "$name" =~ ^[A-Za-z0-9_.-]+$ ]]; then
        echo "$0: '$spec' is not NAME=PATCH[,PATCH...] (NAME: letters, digits, _ . -)" >&2
        exit 2
    fi
    dir=build/ab/$name
    rm -rf "$dir"
    mkdir -p "$dir"
    cp -r cpp "$dir/"
    files=()
    IFS=, read -ra list <<< "$patches"
    for p in "${list[@]}"; do
        files+=("benchmarks/dev/$p")
    done
    git apply --directory="$dir" "${files[@]}"
    echo "$name: ${files[*]} applied to $dir/cpp"
    args+=(--headers "$dir/cpp")
done
cmd=(python3 benchmarks/fused_net_phases.py "$net" "${args[@]}")
echo "${cmd[*]}"
if [ -z "${AB_DRY_RUN:-}" ]; then
    "${cmd[@]}"
fi
