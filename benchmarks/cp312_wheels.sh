# Sourced by the *_site.sh scripts: `cp312_wheels DIR PACKAGE...` downloads the binary
# wheels of the packages alone (no dependencies) for the GPU machine's Python 3.12 on
# manylinux x86_64 into DIR, and unpacks them into DIR/site.
cp312_wheels() {
    local dest=$1
    shift
    local platforms=()
    for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
        manylinux_2_17_x86_64 manylinux2014_x86_64; do
        platforms+=(--platform "$p")
    done
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${platforms[@]}" -d "$dest/w" "$@"
    mkdir -p "$dest/site"
    for w in "$dest"/w/*.whl; do unzip -q -o "$w" -d "$dest/site"; done
}
