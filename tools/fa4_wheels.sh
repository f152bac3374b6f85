#!/usr/bin/env bash
# FlashAttention-4's wheels (flash-attn-4 and its needs: nvidia-cutlass-dsl, which is only metadata and
# a .pth, with nvidia-cutlass-dsl-libs-core (the DSL's Python: cutlass/cute, ...), -libs-base (cutlass/_mlir,
# iket) and -libs-cu13 (the _cutlass_ir .so and libcute_dsl_runtime; -libs-cu12, which its metadata also
# names, is not needed); apache-tvm-ffi, torch-c-dlpack-ext, quack-kernels; protobuf and einops as
# fallbacks; cuda-bindings and cuda-pathfinder come with the device's torch 2.11) onto the device machine
# in parts: together ~98 MiB, more than one device call carries (64 MiB with the working tree: 23.5 MiB of
# tracked files on 2026-11-28, so parts of at most 38 MiB; a 41 MiB part was refused that day).
# The set that imports (flash-attn-4 4.0.0b36, cp312 manylinux x86_64): flash_attn_4 4.0.0b36,
# nvidia_cutlass_dsl{,_libs_core,_libs_base,_libs_cu13} 4.8.1, apache_tvm_ffi 0.1.15.post2,
# torch_c_dlpack_ext 0.1.5, quack_kernels 0.6.5, protobuf 7.36.2, einops 0.8.2. split refuses a set whose
# nvidia-cutlass-dsl wheels lack cutlass/cute or the cu13 _cutlass_ir (an earlier set without -libs-core
# installed but failed with "No module named 'cutlass.cute'"). The parts live in the git-ignored folder
# .whl-fa4/ (never committed); each call carries one part, and a warm machine keeps what a call left in /tmp.
#
#   here:    bash tools/fa4_wheels.sh split DIR [DEST=.whl-fa4] [PART_MIB=36]
#            DIR's wheels cut into byte chunks of at most PART_MIB and packed in order into DEST/part1,
#            DEST/part2, ... (each at most PART_MIB); every part also holds the manifest: SHA256SUMS (the
#            whole wheels' sums, sha256sum -c format) and FILES ("PART CHUNK_SHA256 CHUNK" per chunk).
#   device:  bash tools/fa4_wheels.sh stash     copies every .whl-fa4/partN that this call carried to
#                                               $FA4_PARTS (/tmp/fa4-parts), checking its chunks' sums;
#                                               says which parts are still missing
#            bash tools/fa4_wheels.sh install   stash, then (all parts there) the wheels put back
#                                               together, checked against SHA256SUMS, and installed with
#                                               pip --no-deps --no-index --target $FA4_SITE (/tmp/site-fa4);
#                                               a fallback wheel only where the machine's python lacks
#                                               that package; done once (a marker holds SHA256SUMS);
#                                               a missing part: exit 3 naming it
#            bash tools/fa4_wheels.sh env       the PYTHONPATH line that makes the installed packages
#                                               importable (the .pth nvidia-cutlass-dsl ships is not read
#                                               from a PYTHONPATH folder: its dsl_packages is added)
#
# The sequence on the next GPU session (three parts at PART_MIB 36: 36 + 36 + 26 MiB), each call within
# 30 s of the last one's end so the machine stays warm (a fresh machine has an empty /tmp: start over):
#   call 1: carry [".whl-fa4/part1"]   bash tools/fa4_wheels.sh stash
#   call 2: carry [".whl-fa4/part2"]   bash tools/fa4_wheels.sh stash
#   call 3: carry [".whl-fa4/part3"]   bash tools/fa4_wheels.sh install
#   call 4: carry [".whl"]             bash tools/gpu_attention_baselines.sh attention   (the bench: it adds
#           $FA4_SITE to PYTHONPATH when installed; .whl holds cudnn-frontend's wheel, and with a part
#           beside it a call would pass 64 MiB)
# Making the parts again (here, after `pip download --no-deps` of the wheels into DIR):
#   rm -rf .whl-fa4 && bash tools/fa4_wheels.sh split DIR
set -euo pipefail

FA4_PARTS=$(realpath -m "${FA4_PARTS:-/tmp/fa4-parts}")  # absolute: install reads it from another folder
FA4_SITE=$(realpath -m "${FA4_SITE:-/tmp/site-fa4}")
SRC=${FA4_SRC:-.whl-fa4}   # where a call's carried parts are (relative to the repo root)
PYTHON=${PYTHON:-python3}
# installed only where the machine's python has no such package (the device image has them: carrying
# ours first on PYTHONPATH would shadow the versions its torch and cupy were installed with)
FALLBACK=${FA4_FALLBACK:-cuda_bindings cuda_pathfinder protobuf einops}

die() { echo "fa4_wheels: $1" >&2; exit "${2:-2}"; }

sha() { sha256sum "$1" | cut -d' ' -f1; }

cmd_split() {
  local dir=${1:?usage: split DIR [DEST] [PART_MIB]} dest=${2:-.whl-fa4} mib=${3:-36}
  local limit=$((mib * 1024 * 1024)) part=1 used=0 w name size piece psize
  ls "$dir"/*.whl >/dev/null 2>&1 || die "no wheels in $dir"
  [ ! -e "$dest" ] || die "$dest exists: remove it first"
  # a call carries the working tree too (64 MiB in all): a part that would not fit beside it is refused here
  local tree_mib
  tree_mib=$(cd "$(dirname "$0")/.." && { git ls-files -z 2>/dev/null || true; } | xargs -0 -r stat -c %s 2>/dev/null \
             | awk '{s += $1} END {print int(s / 1048576) + 1}')
  [ "$((mib + tree_mib))" -le 62 ] || die "parts of $mib MiB beside the ${tree_mib} MiB working tree pass what one device call carries (64 MiB): use PART_MIB $((62 - tree_mib)) or less"
  dsl_complete "$dir"
  local tmp; tmp=$(mktemp -d); trap 'rm -rf "$tmp"' RETURN
  mkdir -p "$dest/part1"
  (cd "$dir" && sha256sum -- *.whl) > "$tmp/SHA256SUMS"
  : > "$tmp/FILES"
  # the largest wheels first (their chunks fill whole parts), then the rest by size
  for w in $(cd "$dir" && ls -S -- *.whl); do
    name=$w size=$(stat -c %s "$dir/$w")
    if [ "$size" -gt "$limit" ]; then  # cut: NAME.chunk-00, -01, ... (cat in name order = the wheel)
      split -b "$limit" -d -a 2 "$dir/$w" "$tmp/$name.chunk-"
    else
      cp "$dir/$w" "$tmp/$name"
    fi
    for piece in $(cd "$tmp" && ls -- "$name" "$name".chunk-* 2>/dev/null); do
      psize=$(stat -c %s "$tmp/$piece")
      if [ $((used + psize)) -gt "$limit" ] && [ "$used" -gt 0 ]; then
        part=$((part + 1)) used=0
        mkdir -p "$dest/part$part"
      fi
      echo "$part $(sha "$tmp/$piece") $piece" >> "$tmp/FILES"
      mv "$tmp/$piece" "$dest/part$part/"
      used=$((used + psize))
    done
  done
  for d in "$dest"/part*; do cp "$tmp/SHA256SUMS" "$tmp/FILES" "$d/"; done
  echo "split $(wc -l < "$tmp/SHA256SUMS") wheels of $dir into $part parts under $dest (at most $mib MiB each):"
  du -sh "$dest"/part* | sed 's/^/  /'
}

# dsl_complete DIR: where DIR has nvidia-cutlass-dsl's wheels, they hold the DSL's Python (cutlass/cute,
# in nvidia-cutlass-dsl-libs-core), cutlass/_mlir/_mlir_libs (-libs-base) and a cu13 _cutlass_ir (-libs-cu13)
dsl_complete() {
  ls "$1"/nvidia_cutlass_dsl*.whl >/dev/null 2>&1 || return 0
  "$PYTHON" - "$1" <<'EOF' || die "the nvidia-cutlass-dsl wheels in $1 are incomplete (pip download its -libs-core, -libs-base and -libs-cu13 of the same version too)"
import glob, re, sys, zipfile
names = [n for w in glob.glob(sys.argv[1] + "/nvidia_cutlass_dsl*.whl") for n in zipfile.ZipFile(w).namelist()]
need = {"cutlass/cute (nvidia-cutlass-dsl-libs-core)": r"nvidia_cutlass_dsl/dsl_packages/cutlass/cute/__init__\.py$",
        "cutlass/_mlir/_mlir_libs (nvidia-cutlass-dsl-libs-base)": r"nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs/__init__\.py$",
        "the cu13 _cutlass_ir (nvidia-cutlass-dsl-libs-cu13)": r"/_cutlass_ir\.cu13\..*\.so$"}
missing = [what for what, rx in need.items() if not any(re.search(rx, n) for n in names)]
for what in missing:
    print(f"fa4_wheels: no {what} in {sys.argv[1]}'s nvidia_cutlass_dsl*.whl", file=sys.stderr)
sys.exit(bool(missing))
EOF
}

# the manifest of the parts: the first FILES found carried or stashed
manifest() {
  local f
  for f in "$SRC"/part*/FILES "$FA4_PARTS"/part*/FILES; do
    [ -f "$f" ] && { echo "$(dirname "$f")"; return 0; }
  done
  return 1
}

# part_ok DIR N: every chunk of part N is in DIR with its sum
part_ok() {
  local dir=$1 n=$2 p s f
  while read -r p s f; do
    [ "$p" = "$n" ] || continue
    [ -f "$dir/$f" ] && [ "$(sha "$dir/$f")" = "$s" ] || return 1
  done < "$dir/FILES"
}

nparts() { cut -d' ' -f1 "$1/FILES" | sort -n | tail -1; }

cmd_stash() {
  local m n got=() missing=() d
  m=$(manifest) || die "no part carried (.whl-fa4/partN) and none stashed in $FA4_PARTS" 3
  n=$(nparts "$m")
  mkdir -p "$FA4_PARTS"
  for d in "$SRC"/part*; do
    [ -d "$d" ] || continue
    local k=${d##*/part}
    if [ -f "$FA4_PARTS/part$k/FILES" ] && part_ok "$FA4_PARTS/part$k" "$k"; then
      echo "part $k: already stashed in $FA4_PARTS/part$k"
      continue
    fi
    part_ok "$d" "$k" || die "part $k as carried in $d is incomplete or its sums differ" 4
    rm -rf "$FA4_PARTS/part$k.tmp" && cp -r "$d" "$FA4_PARTS/part$k.tmp" && rm -rf "$FA4_PARTS/part$k" \
      && mv "$FA4_PARTS/part$k.tmp" "$FA4_PARTS/part$k"
    echo "part $k: stashed in $FA4_PARTS/part$k ($(du -sh "$FA4_PARTS/part$k" | cut -f1))"
  done
  for k in $(seq 1 "$n"); do
    if [ -f "$FA4_PARTS/part$k/FILES" ] && part_ok "$FA4_PARTS/part$k" "$k"; then got+=("$k"); else missing+=("$k"); fi
  done
  echo "stashed parts: ${got[*]:-none} of $n; missing: ${missing[*]:-none}"
  MISSING=${missing[*]:-}
}

cmd_install() {
  MISSING=""
  cmd_stash
  [ -z "$MISSING" ] || die "cannot install: part(s) $MISSING missing from $FA4_PARTS (carry .whl-fa4/part$(echo "$MISSING" | cut -d' ' -f1) in a call and run stash; a machine that went cold lost the stashed parts)" 3
  local sums="$FA4_PARTS/part1/SHA256SUMS" wheels="$FA4_PARTS/wheels" w s name dist
  if [ -f "$FA4_SITE/.fa4-installed" ] && cmp -s "$sums" "$FA4_SITE/.fa4-installed"; then
    echo "already installed in $FA4_SITE (the same wheels)"; return 0
  fi
  rm -rf "$wheels" && mkdir -p "$wheels"
  while read -r s name; do
    # the chunks of this wheel in name order (a whole wheel is its own single piece), from any part
    local pieces=()
    while read -r _p _s f; do
      case "$f" in "$name"|"$name".chunk-*) pieces+=("$(ls "$FA4_PARTS"/part*/"$f" | head -1)") ;; esac
    done < <(sort -k3 "$FA4_PARTS/part1/FILES")
    [ "${#pieces[@]}" -gt 0 ] || die "no piece of $name in the parts" 4
    cat "${pieces[@]}" > "$wheels/$name"
  done < "$sums"
  (cd "$wheels" && sha256sum --quiet -c "$sums") || die "a reassembled wheel's sha256 differs from SHA256SUMS" 4
  echo "reassembled and checked $(wc -l < "$sums") wheels in $wheels"
  local install=()
  for w in "$wheels"/*.whl; do
    dist=$(basename "$w" | cut -d- -f1)
    if [[ " $FALLBACK " == *" $dist "* ]] && have=$(PYTHONPATH= "$PYTHON" -c \
        "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$dist" 2>/dev/null); then
      echo "kept the machine's $dist $have (not installing $(basename "$w"))"
      continue
    fi
    install+=("$w")
  done
  rm -rf "$FA4_SITE"
  "$PYTHON" -m pip install -q --no-deps --no-index --no-compile --no-cache-dir --target "$FA4_SITE" "${install[@]}"
  if [ -d "$FA4_SITE/nvidia_cutlass_dsl" ] && [ ! -f "$FA4_SITE/nvidia_cutlass_dsl/dsl_packages/cutlass/cute/__init__.py" ]; then
    die "installed, but $FA4_SITE/nvidia_cutlass_dsl/dsl_packages has no cutlass/cute (nvidia-cutlass-dsl-libs-core missing from the parts): import flash_attn.cute would fail" 5
  fi
  cp "$sums" "$FA4_SITE/.fa4-installed"
  echo "installed into $FA4_SITE: $(for w in "${install[@]}"; do basename "$w" | cut -d- -f1,2; done | tr '\n' ' ')"
  cmd_env
}

cmd_env() {
  echo "export PYTHONPATH=\${PYTHONPATH:+\$PYTHONPATH:}$FA4_SITE:$FA4_SITE/nvidia_cutlass_dsl/dsl_packages"
}

case "${1:-}" in
  split) shift; cmd_split "$@" ;;
  stash) cmd_stash ;;
  install) cmd_install ;;
  env) cmd_env ;;
  *) die "usage: $0 split DIR [DEST] [PART_MIB] | stash | install | env" ;;
esac
