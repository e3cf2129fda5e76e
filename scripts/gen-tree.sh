#!/usr/bin/env bash
# Parent arrays for the tree plan-time benchmarks (BENCHMARKS.md, issue 13), one integer a
# line for `compilemask plan ... --set parents=@FILE`:
#   gen-tree.sh KIND N [SEED] > FILE
# KIND:
#   preorder  a complete 4-ary tree numbered in depth-first preorder (paths of few intervals)
#   bfs       the same tree numbered breadth first (heap order: parent (i - 1) / 4)
#   shuffled  the same tree with its labels randomly permuted (parents after children too)
#   random    a random recursive tree: node i's parent uniform among nodes 0 .. i - 1
# The random numbers are Park-Miller's generator (x * 16807 mod 2^31 - 1, exact in awk's
# doubles), so a seed gives the same file with any awk.
set -euo pipefail
kind=${1:?usage: gen-tree.sh preorder|bfs|shuffled|random N [SEED]}
n=${2:?usage: gen-tree.sh preorder|bfs|shuffled|random N [SEED]}
seed=${3:-1}
case "$kind" in preorder|bfs|shuffled|random) ;; *)
  echo "gen-tree.sh: unknown kind '$kind'; expected preorder, bfs, shuffled or random" >&2; exit 2;;
esac
awk -v kind="$kind" -v n="$n" -v seed="$seed" '
function rnd(m) { x = (x * 16807) % 2147483647; return x % m }
BEGIN {
  x = seed % 2147483646 + 1
  if (kind == "random") {
    print -1
    for (i = 1; i < n; i++) print rnd(i)
    exit
  }
  for (i = 0; i < n; i++) p[i] = (i == 0) ? -1 : int((i - 1) / 4)
  if (kind == "bfs") { for (i = 0; i < n; i++) print p[i]; exit }
  # pos[v]: the label of heap node v.
  if (kind == "preorder") {
    # Depth-first, children in order: push them last-first onto a stack.
    top = 0; st[top++] = 0; next_label = 0
    while (top > 0) {
      u = st[--top]; pos[u] = next_label++
      for (c = 4 * u + 4; c >= 4 * u + 1; c--) if (c < n) st[top++] = c
    }
  } else {
    for (i = 0; i < n; i++) pos[i] = i
    for (i = n - 1; i > 0; i--) { j = rnd(i + 1); t = pos[i]; pos[i] = pos[j]; pos[j] = t }
  }
  for (v = 0; v < n; v++) out[pos[v]] = (p[v] < 0) ? -1 : pos[p[v]]
  for (i = 0; i < n; i++) print out[i]
}'
