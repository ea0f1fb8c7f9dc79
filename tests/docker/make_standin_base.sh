#!/usr/bin/env bash
# A stand-in for the NeMo base image, for machines that cannot pull nvcr.io: Debian bookworm (debootstrap), this
# machine's CPython 3.11 and the packages megatron-kd needs at the versions installed here (torch CPU wheel,
# megatron-core, hydra, tokenizers, ...), installed from this machine's pip index, imported with `docker import`.
# pip inside the image is offline (no index; setuptools and wheel as local wheels), so `pip install -e .` in
# docker/Dockerfile finds everything already there, as it does on the NeMo base.
#
#   bash tests/docker/make_standin_base.sh [IMAGE] [WORKDIR]      (default megatron-kd-base:standin, /tmp/kd_standin)
#   docker build -f docker/Dockerfile --build-arg BASE_IMAGE=megatron-kd-base:standin -t megatron-kd:standin .
#   docker run --rm megatron-kd:standin demo --small
set -euo pipefail
IMAGE=${1:-megatron-kd-base:standin}
WORK=${2:-/tmp/kd_standin}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
PY=$(python3 -c 'import sys; print(sys.prefix)')           # this machine's CPython (a pyenv build here)
VER=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
ROOT=$WORK/rootfs
pins() {  # name==version of what this machine has, for the packages megatron-kd installs
    python3 -m pip freeze 2>/dev/null | grep -iE '^(torch|megatron-core|numpy|hydra-core|omegaconf|antlr4-python3-runtime|tokenizers|matplotlib|tqdm|pyyaml|psutil|packaging|contourpy|cycler|fonttools|kiwisolver|pillow|pyparsing|python-dateutil|six|typing.extensions|filelock|sympy|networkx|jinja2|fsspec|mpmath|markupsafe)==' 
}
mkdir -p "$WORK"
if [ ! -x "$ROOT/bin/bash" ]; then
    debootstrap --variant=minbase --include=ca-certificates,libssl3,libffi8,zlib1g,libsqlite3-0,libbz2-1.0,liblzma5,libreadline8,libncursesw6,libuuid1,libgomp1 \
        bookworm "$ROOT" "$MIRROR"
fi
# CPython without its site-packages, at the same prefix (its libpython is found through that path)
mkdir -p "$ROOT$PY"
[ -x "$ROOT$PY/bin/python3" ] || tar -C "$PY" --exclude="./lib/python$VER/site-packages/*" -cf - . | tar -C "$ROOT$PY" -xf -
mkdir -p "$ROOT/opt/wheels"
python3 -m pip download -q -d "$ROOT/opt/wheels" "setuptools>=68" wheel  # with their dependencies (packaging)
mapfile -t PINS < <(pins)
[ -d "$ROOT$PY/lib/python$VER/site-packages/torch" ] || python3 -m pip install -q --no-warn-script-location --root "$ROOT" --prefix "$PY" --no-compile --ignore-installed "pip==$(python3 -m pip --version | cut -d' ' -f2)" "${PINS[@]}"
# the image's interpreter sees them (and nothing of this machine's)
chroot "$ROOT" "$PY/bin/python3" -c "import torch, megatron.core, tokenizers, hydra, matplotlib; print('base ok', torch.__version__)"
for x in python python3 pip pip3; do ln -sf "$PY/bin/$x" "$ROOT/usr/local/bin/$x"; done
printf '[global]\nno-index = true\nfind-links = /opt/wheels\ndisable-pip-version-check = true\n' > "$ROOT/etc/pip.conf"
rm -rf "$ROOT/var/cache/apt/archives/"*.deb "$ROOT/var/lib/apt/lists/"*
tar -C "$ROOT" -c . | docker import \
    -c "ENV PATH=$PY/bin:/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8" \
    -c 'CMD ["/bin/bash"]' - "$IMAGE"
docker run --rm "$IMAGE" python -c "import sys, torch, megatron.core; print(sys.version.split()[0], torch.__version__, megatron.core.__version__)"
