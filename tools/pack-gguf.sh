#!/usr/bin/env bash
# Carry a pulled GGUF to the offline GPU machine in parts small enough for one device call each.
#
# Here (repo root):   bash tools/pack-gguf.sh smollm2-135m-instruct
#   splits $ONNXGEN_HOME/gguf/NAME.gguf into git-ignored folders .gg1/ .gg2/ ... (< 56 MiB each).
# There, one call per folder, each right after the last (carry=[".ggK"]):   bash .ggK/stash.sh
#   the last part joins them, checks the sha256 and puts the file where `onnxgen pull` looks
#   ($ONNXGEN_HOME/gguf/ on that machine, default ~/.cache/onnxgen), so pull builds without a network.
set -euo pipefail
name=${1:?usage: pack-gguf.sh NAME}
top=$(git rev-parse --show-toplevel); cd "$top"
src="${ONNXGEN_HOME:-$HOME/.cache/onnxgen}/gguf/$name.gguf"
[ -f "$src" ] || { echo "$src not found: run 'onnxgen pull $name' first"; exit 2; }
sum=$(sha256sum "$src" | cut -c1-64)
work=$(mktemp -d)
split -b 55M -d -a 2 "$src" "$work/part."
rm -rf .gg[0-9]*
parts=("$work"/part.*); n=${#parts[@]}
for i in $(seq 1 "$n"); do
  d=.gg$i; mkdir -p "$d"; mv "${parts[$((i-1))]}" "$d/"
  grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude
  cat > "$d/stash.sh" <<EOS
#!/usr/bin/env bash
[ $i -ne 1 ] || rm -rf /tmp/ggparts
mkdir -p /tmp/ggparts && cp "\$(dirname "\$0")"/part.* /tmp/ggparts/
echo "gguf parts held: \$(ls /tmp/ggparts | wc -l) of $n"
[ $i -eq $n ] || exit 0
home=\${ONNXGEN_HOME:-\$HOME/.cache/onnxgen}; mkdir -p "\$home/gguf"
cat /tmp/ggparts/part.* > "\$home/gguf/$name.gguf.tmp"
[ "\$(sha256sum "\$home/gguf/$name.gguf.tmp" | cut -c1-64)" = "$sum" ] || { echo "sha256 mismatch"; exit 4; }
mv "\$home/gguf/$name.gguf.tmp" "\$home/gguf/$name.gguf" && echo "placed \$home/gguf/$name.gguf"
EOS
done
rm -rf "$work"
echo "wrote $n part folders (.gg1 .. .gg$n); carry each in its own device call, in order"
