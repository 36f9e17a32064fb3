#!/usr/bin/env bash
# A change against its base in one device call: the same stages on both sides of a comparison,
# on the same machine, without git there (a call carries the working tree, not its history).
#
#   bash benchmarks/ab_base.sh prepare REV   # here, in the repository root: the base side
#                                            # into .ab-base/ (ignored)
#   then a call that carries .ab-base (carry: [".ab-base", ...]) and runs, for instance,
#   bash benchmarks/gpu_run.sh w3 base w3 head w3   # the change, the base, the change again
#
# Several bases: `prepare REV DIR` and `swap base|head DIR` use DIR instead of .ab-base
# (gpu_run.sh's stages `base:DIR` and `head:DIR`), e.g. the parents of two changes in one call.
#
# prepare REV writes, for every tracked file that differs between REV and the working tree,
# its content at REV under the same path in .ab-base/, lists in .ab-base/ABSENT the files
# that REV lacks, and records REV (resolved) in .ab-base/REV. swap base (gpu_run.sh's stage
# `base`) keeps the working tree's versions of those files in .ab-base/.head/, then puts the
# base's in and removes the ABSENT ones; swap head (stage `head`) puts the kept versions back.
# Both are idempotent. The harness (this script and gpu_run.sh, which runs while it swaps) is
# the change's on both sides. The editable installs read the swapped sources at the next import; a
# change to a package's metadata (entry points, dependencies) needs a reinstall and is not
# covered.
set -euo pipefail
base_dir=.ab-base
harness=(benchmarks/ab_base.sh benchmarks/gpu_run.sh)

prepare() {  # prepare REV
    local rev
    rev=$(git rev-parse --verify "$1^{commit}")
    rm -rf "$base_dir"
    mkdir -p "$base_dir"
    echo "$rev" > "$base_dir/REV"
    : > "$base_dir/ABSENT"
    local path
    while IFS= read -r -d '' path; do
        if [[ " ${harness[*]} " == *" $path "* ]]; then
            continue
        elif git cat-file -e "$rev:$path" 2>/dev/null; then
            mkdir -p "$base_dir/$(dirname "$path")"
            git show "$rev:$path" > "$base_dir/$path"
        else
            echo "$path" >> "$base_dir/ABSENT"
        fi
    done < <(git diff -z --name-only --no-renames "$rev" --)
    echo "base $(git rev-parse --short "$rev"): $(base_files | tr -cd '\0' | wc -c) files," \
        "$(wc -l < "$base_dir/ABSENT") absent there"
}

base_files() {  # the paths of the base's files, relative to the tree (NUL-separated)
    (cd "$base_dir" && find . -type f -not -path "./.head/*" -not -name REV -not -name ABSENT \
        -printf '%P\0')
}

swap_base() {
    [ -f "$base_dir/REV" ] || { echo "no $base_dir/REV: run 'prepare REV' first" >&2; exit 1; }
    if [ ! -d "$base_dir/.head" ]; then  # keep the change's side once
        mkdir -p "$base_dir/.head"
        local path
        while IFS= read -r -d '' path; do
            if [ -e "$path" ]; then
                mkdir -p "$base_dir/.head/$(dirname "$path")"
                cp -p "$path" "$base_dir/.head/$path"
            fi
        done < <(base_files; tr '\n' '\0' < "$base_dir/ABSENT")
    fi
    base_files | (cd "$base_dir" && xargs -0 -r cp --parents -t ..)
    tr '\n' '\0' < "$base_dir/ABSENT" | xargs -0 -r rm -f
    echo "side: base $(cut -c1-7 "$base_dir/REV")"
}

swap_head() {
    [ -d "$base_dir/.head" ] || { echo "side: head (never swapped)"; return; }
    (cd "$base_dir/.head" && find . -type f -printf '%P\0' | xargs -0 -r cp -p --parents -t ../..)
    base_files | while IFS= read -r -d '' path; do
        [ -e "$base_dir/.head/$path" ] || rm -f "$path"  # added by the base alone
    done
    echo "side: head"
}

usage="usage: $0 prepare REV [DIR] | swap base|head [DIR]"
[ -z "${3:-}" ] || base_dir=$3
case "${1:-}" in
    prepare) [ $# -ge 2 ] || { echo "$usage" >&2; exit 2; }; prepare "$2" ;;
    swap) case "${2:-}" in
              base) swap_base ;;
              head) swap_head ;;
              *) echo "$usage" >&2; exit 2 ;;
          esac ;;
    *) echo "$usage" >&2; exit 2 ;;
esac
