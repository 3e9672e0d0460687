"""The model-free drafters' hot paths compiled: the n-gram index, :meth:`SuffixDrafter.speculate
<leapdecode.spec.suffix.SuffixDrafter.speculate>` and its draft choice, prompt lookup's match (spec/ngram.py) and
Token Recycling's learning and drafts (spec/recycling.py), in C++, giving the Python code's drafts and tables to the bit.

Why: in pure Python a step of the suffix drafter cost ~30-45 us of CPU on the default model's outputs (replay,
``benchmarks/replay.py``): bringing the request's index up to date (tuples and dictionary updates for every new
token and n-gram size) and two speculations (occurrence chains, match lengths, continuation rows, a best-first tree
over them), each a few hundred Python operations. That is noise beside a CPU decode step, but at batch 64 on a GPU
it is milliseconds a step, every step (issue 19 budgets 30 us a step).

:class:`CompiledIndex` has :class:`~leapdecode.spec.index.NgramIndex`'s surface (``extend``, ``break_sequence``,
``occurrences``, ``evict_before``, ``len``, ``base``, ``end``, ``last``, ``tokens`` as a copy) over the same layout
(per n, a hash map from the n-gram to its newest follower, and a ``previous`` chain over the stream), so a drafter
swaps one for the other. :func:`speculate` is the Python ``speculate`` statement for statement: the same occurrence
choice, match lengths, pattern order and limits, continuation rows (periodic in the request's own index, cut at a
sentinel in the global one) and the best-first tree with its tie-breaks (probability, then the newest occurrence,
then push order), its probabilities computed in the same order (built with ``-ffp-contract=off``). Tokens are
stored as int32 (a token id must be in [0, 2**31)). Memory: ~245 bytes per indexed token with n-gram sizes 1-4 (the
Python index: ~465; resident set growth over 200,000 tokens of 5,000 distinct ids).

Built at first use by :func:`leapdecode.native.build` (~20 s, cached); where that fails, or with
``LEAPDECODE_NO_CPU_KERNELS=1``, :func:`core` is None and the suffix drafter keeps its Python index and code.
"""
from __future__ import annotations

import functools
from typing import Sequence

from leapdecode.spec.index import as_int_list

_SOURCE = r"""
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <algorithm>
#include <cstdint>
#include <limits>
#include <queue>
#include <stdexcept>
#include <unordered_map>
#include <vector>

namespace py = pybind11;
using i64 = int64_t;

struct Gram {                       // an n-gram of up to 4 tokens (unused slots 0; one map per n)
  int32_t t[4];
  bool operator==(const Gram& o) const {
    return t[0] == o.t[0] && t[1] == o.t[1] && t[2] == o.t[2] && t[3] == o.t[3];
  }
};
struct GramHash {
  size_t operator()(const Gram& g) const {
    uint64_t h = 0;
    for (int i = 0; i < 4; ++i) h = (h ^ (uint32_t)g.t[i]) * 0x9E3779B97F4A7C15ull;
    return (size_t)(h ^ (h >> 31));
  }
};

struct Index {
  std::vector<int> sizes;                                    // ascending
  std::vector<int32_t> tokens;                               // from base on; -1 = a sentinel
  i64 base = 0, floor_ = 0;                                  // n-grams start at or after floor_
  std::vector<std::unordered_map<Gram, i64, GramHash>> tables;   // per size: n-gram -> newest follower
  std::vector<std::vector<i64>> previous;                    // per size: previous[f - base] = older follower

  explicit Index(std::vector<int> s) {
    std::sort(s.begin(), s.end());
    s.erase(std::unique(s.begin(), s.end()), s.end());
    if (s.empty() || s.front() < 1 || s.back() > 4)
      throw py::value_error("the compiled n-gram index holds sizes 1..4");
    sizes = s;
    tables.resize(s.size());
    previous.resize(s.size());
  }
  i64 end() const { return base + (i64)tokens.size(); }
  Gram gram(const int32_t* p, int n) const {
    Gram g{{0, 0, 0, 0}};
    for (int k = 0; k < n; ++k) g.t[k] = p[k];
    return g;
  }
  int slot(int n) const {
    for (size_t i = 0; i < sizes.size(); ++i) if (sizes[i] == n) return (int)i;
    return -1;
  }
  void extend(const std::vector<i64>& add) {
    for (i64 t : add)
      if (t < 0 || t > std::numeric_limits<int32_t>::max())
        throw py::value_error("token ids must be in [0, 2**31) for the compiled n-gram index");
    size_t old = tokens.size();
    tokens.insert(tokens.end(), add.begin(), add.end());
    i64 start = base + (i64)old, e = end();
    for (size_t si = 0; si < sizes.size(); ++si) {
      int n = sizes[si];
      auto& table = tables[si];
      auto& prev = previous[si];
      i64 first_f = std::min(std::max(start, floor_ + n), e);
      for (i64 f = start; f < first_f; ++f) prev.push_back(-1);
      for (i64 f = first_f; f < e; ++f) {
        auto res = table.try_emplace(gram(&tokens[f - base - n], n), f);
        if (res.second) prev.push_back(-1);
        else { prev.push_back(res.first->second); res.first->second = f; }
      }
    }
  }
  void break_sequence() {
    tokens.push_back(-1);
    for (auto& prev : previous) prev.push_back(-1);
    floor_ = end();
  }
  // followers of the n-gram at p (n tokens), oldest first; at most `limit` (the newest; < 0: all)
  std::vector<i64> occurrences(const int32_t* p, int n, i64 limit) const {
    std::vector<i64> out;
    int si = slot(n);
    if (si < 0) return out;
    auto it = tables[si].find(gram(p, n));
    i64 f = it == tables[si].end() ? -1 : it->second;
    const auto& prev = previous[si];
    while (f >= base + n && limit != 0) {
      out.push_back(f);
      f = prev[f - base];
      --limit;
    }
    std::reverse(out.begin(), out.end());
    return out;
  }
  void evict_before(i64 position) {
    position = std::min(position, end());
    i64 cut = position - base;
    if (cut <= 0) return;
    for (size_t si = 0; si < sizes.size(); ++si) {
      int n = sizes[si];
      auto& table = tables[si];
      i64 stop = std::min(cut, (i64)tokens.size() - n);
      for (i64 s = 0; s < stop; ++s) {
        auto it = table.find(gram(&tokens[s], n));
        if (it != table.end() && it->second < position + n) table.erase(it);
      }
      previous[si].erase(previous[si].begin(), previous[si].begin() + cut);
    }
    tokens.erase(tokens.begin(), tokens.begin() + cut);
    base = position;
    floor_ = std::max(floor_, position);
  }
};

struct Tree {
  std::vector<int32_t> tokens;
  std::vector<int> parents;
  std::vector<double> probs;
  double expected = 0.0;      // the sum of probs, summed in order
  int match_length = 0;
};

// what followed each occurrence, at most `limit` tokens: continued periodically past the end of the request's own
// stream (`periodic`), cut at a sentinel in another source
static std::vector<std::vector<int32_t>> rows_of(const Index& src, const std::vector<i64>& followers, i64 limit,
                                                 bool periodic) {
  std::vector<std::vector<int32_t>> rows;
  const auto& toks = src.tokens;
  i64 len = (i64)toks.size();
  for (i64 f : followers) {
    i64 start = std::min(f - src.base, len);           // (a follower always has a token after it: start < len)
    i64 stop = std::min(len, start + std::max<i64>(limit, 0));
    std::vector<int32_t> row(toks.begin() + start, toks.begin() + stop);
    if (periodic) {
      i64 period = len - start;
      while (period > 0 && (i64)row.size() < limit) row.push_back(row[row.size() - period]);
    } else {
      auto s = std::find(row.begin(), row.end(), -1);
      row.erase(s, row.end());
    }
    rows.push_back(std::move(row));
  }
  return rows;
}

struct Entry {
  double p;
  i64 latest, order;
  int depth, parent, tok, members;    // members: index into the pool of member lists
};
struct Later {                         // the heap pops the highest p, then the newest, then the first pushed
  bool operator()(const Entry& a, const Entry& b) const {
    if (a.p != b.p) return a.p < b.p;
    if (a.latest != b.latest) return a.latest < b.latest;
    return a.order > b.order;
  }
};

// the best-first tree over continuation rows (oldest first): SuffixDrafter's expand_continuations
static Tree expand(const std::vector<std::vector<int32_t>>& rows, i64 max_nodes, double min_prob, bool tree) {
  Tree out;
  if (max_nodes <= 0 || rows.empty()) return out;
  std::vector<int> distinct;            // row index of each distinct row, in order of first sight
  std::vector<i64> counts, recency;
  for (size_t i = 0; i < rows.size(); ++i) {
    size_t d = 0;
    for (; d < distinct.size(); ++d) if (rows[distinct[d]] == rows[i]) break;
    if (d == distinct.size()) { distinct.push_back((int)i); counts.push_back(0); recency.push_back(0); }
    counts[d] += 1;
    recency[d] = (i64)i;
  }
  if (distinct.size() == 1) {
    const auto& row = rows[distinct[0]];
    for (i64 k = 0; k < (i64)row.size() && k < max_nodes; ++k) {
      out.tokens.push_back(row[k]);
      out.parents.push_back((int)k - 1);
      out.probs.push_back(1.0);
      out.expected += 1.0;
    }
    return out;
  }
  std::vector<std::vector<int>> pool;
  std::priority_queue<Entry, std::vector<Entry>, Later> heap;
  i64 order = 0;
  struct Child { int tok; std::vector<int> members; i64 c, latest; };
  auto push_children = [&](const std::vector<int>& group, int depth, double prob, int parent) {
    if (group.size() == 1) {
      const auto& row = rows[distinct[group[0]]];
      if ((int)row.size() > depth && prob >= min_prob) {
        pool.push_back(group);
        heap.push(Entry{prob, recency[group[0]], order++, depth, parent, row[depth], (int)pool.size() - 1});
      }
      return;
    }
    i64 total = 0;
    std::vector<Child> children;
    for (int r : group) {
      const auto& row = rows[distinct[r]];
      i64 c = counts[r];
      total += c;
      if ((int)row.size() > depth) {
        int tok = row[depth];
        Child* child = nullptr;
        for (auto& ch : children) if (ch.tok == tok) { child = &ch; break; }
        if (!child) children.push_back(Child{tok, {r}, c, recency[r]});
        else {
          child->members.push_back(r);
          child->c += c;
          if (recency[r] > child->latest) child->latest = recency[r];
        }
      }
    }
    std::vector<double> ps;
    for (auto& ch : children) ps.push_back(prob * (double)ch.c / (double)total);
    size_t lo = 0, hi = children.size();
    if (!tree && hi > 0) {               // the most likely child alone (ties: the newest)
      size_t best = 0;
      for (size_t k = 1; k < hi; ++k)
        if (ps[k] > ps[best] || (ps[k] == ps[best] && children[k].latest > children[best].latest)) best = k;
      lo = best; hi = best + 1;
    }
    for (size_t k = lo; k < hi; ++k) {
      if (ps[k] >= min_prob) {
        pool.push_back(std::move(children[k].members));
        heap.push(Entry{ps[k], children[k].latest, order++, depth, parent, children[k].tok, (int)pool.size() - 1});
      }
    }
  };
  std::vector<int> all(distinct.size());
  for (size_t d = 0; d < distinct.size(); ++d) all[d] = (int)d;
  push_children(all, 0, 1.0, -1);
  while (!heap.empty() && (i64)out.tokens.size() < max_nodes) {
    Entry e = heap.top();
    heap.pop();
    out.tokens.push_back(e.tok);
    out.parents.push_back(e.parent);
    out.probs.push_back(e.p);
    out.expected += e.p;
    std::vector<int> members = pool[e.members];
    push_children(members, e.depth + 1, e.p, (int)out.tokens.size() - 1);
  }
  return out;
}

struct Options {                       // SuffixDrafter's options, as speculate reads them
  i64 max_match;
  double factor, offset, min_prob;
  bool tree;
  i64 max_occurrences, max_patterns;
};

// SuffixDrafter.speculate: the best tree, and (`recent`) the newest longest match's continuation and its length
static Tree best_tree(const Index& src, const Index& ctx, i64 max_draft, const Options& o, bool recent,
                      std::vector<int32_t>& recent_row, int& recent_match) {
  const i64 max_match = o.max_match, max_occurrences = o.max_occurrences, max_patterns = o.max_patterns;
  const double factor = o.factor, offset = o.offset, min_prob = o.min_prob;
  const bool tree = o.tree;
  const auto& c = ctx.tokens;
  i64 len = (i64)c.size();
  std::vector<i64> followers;
  int anchor = 0;
  for (auto it = src.sizes.rbegin(); it != src.sizes.rend(); ++it) {
    int n = *it;
    if (n <= len) {
      followers = src.occurrences(&c[len - n], n, max_occurrences);
      if (!followers.empty()) { anchor = n; break; }
    }
  }
  Tree best;
  if (!followers.empty()) {
    i64 limit_m = std::min(max_match, len);
    std::vector<int> lengths;
    for (i64 f : followers) {
      i64 i = f - src.base - 1 - anchor, j = len - 1 - anchor, m = anchor;
      while (m < limit_m && i >= 0 && src.tokens[i] == c[j]) { --i; --j; ++m; }
      lengths.push_back((int)m);
    }
    std::vector<int> uniq(lengths);
    std::sort(uniq.begin(), uniq.end(), std::greater<int>());
    uniq.erase(std::unique(uniq.begin(), uniq.end()), uniq.end());
    bool periodic = &src == &ctx;
    size_t previous_count = 0;
    for (size_t tried = 0; tried < uniq.size(); ++tried) {
      int length = uniq[tried];
      double v = factor * (double)length + offset;
      i64 limit = v >= (double)max_draft ? max_draft : (i64)v;
      if ((i64)tried == max_patterns || (double)limit <= best.expected) break;
      std::vector<i64> chosen;
      for (size_t k = 0; k < followers.size(); ++k) if (lengths[k] >= length) chosen.push_back(followers[k]);
      if (chosen.size() == previous_count) continue;
      previous_count = chosen.size();
      Tree cand = expand(rows_of(src, chosen, limit, periodic), limit, min_prob, tree);
      cand.match_length = length;
      if (cand.expected > best.expected) best = std::move(cand);
    }
    if (recent) {
      int longest = *std::max_element(lengths.begin(), lengths.end());
      i64 newest = -1;
      for (size_t k = 0; k < followers.size(); ++k) if (lengths[k] == longest) newest = std::max(newest, followers[k]);
      recent_row = rows_of(src, {newest}, max_draft, periodic)[0];
      recent_match = longest;
    }
  }
  return best;
}

// SuffixDrafter.speculate: (tokens, parents, probs, match_length, recent, recent_match)
static py::tuple speculate(const Index& src, const Index& ctx, i64 max_draft, i64 max_match, double factor,
                           double offset, double min_prob, bool tree, i64 max_occurrences, i64 max_patterns,
                           bool recent) {
  std::vector<int32_t> recent_row;
  int recent_match = 0;
  Options o{max_match, factor, offset, min_prob, tree, max_occurrences, max_patterns};
  Tree best = best_tree(src, ctx, max_draft, o, recent, recent_row, recent_match);
  return py::make_tuple(best.tokens, best.parents, best.probs, best.match_length, recent_row, recent_match);
}

// SuffixDrafter.draft_one after its index is brought up to date: the better of the local and (when it holds
// anything) the global tree, ties to the local one; (tokens, parents or None for a chain, first-token probability)
static py::tuple draft(const Index& local, const Index& global, i64 max_draft, i64 max_match, double factor,
                       double offset, double min_prob, bool tree, i64 max_occurrences, i64 max_patterns) {
  std::vector<int32_t> unused_row;
  int unused_match = 0;
  Options o{max_match, factor, offset, min_prob, tree, max_occurrences, max_patterns};
  Tree best = best_tree(local, local, max_draft, o, false, unused_row, unused_match);
  if (!global.tokens.empty()) {
    Tree other = best_tree(global, local, max_draft, o, false, unused_row, unused_match);
    if (other.expected > best.expected) best = std::move(other);
  }
  if (best.tokens.empty()) return py::make_tuple(py::list(), py::none(), 0.0);
  bool chain = true;
  double first = 0.0;
  for (size_t i = 0; i < best.parents.size(); ++i) {
    if (best.parents[i] != (int)i - 1) chain = false;
    if (best.parents[i] == -1) first += best.probs[i];
  }
  py::object parents = chain ? py::object(py::none()) : py::object(py::cast(best.parents));
  return py::make_tuple(best.tokens, parents, first > 1.0 ? 1.0 : first);
}

// NgramDrafter's lookup: the longest suffix of `ix` (n_max down to n_min tokens, shorter than the stream) with an
// earlier occurrence, and its `scan` most recent occurrences' continuations (periodic, `max_draft` tokens), newest
// first (only the newest unless `all`); (n, how many of those occurrences continue with the newest's first token,
// how many there are, continuations), or None
static py::object ngram_match(const Index& ix, int n_min, int n_max, i64 scan, i64 max_draft, bool all) {
  i64 len = (i64)ix.tokens.size();
  for (i64 n = std::min<i64>(n_max, len - 1); n >= n_min; --n) {
    std::vector<i64> followers = ix.occurrences(&ix.tokens[len - n], (int)n, scan);
    if (followers.empty()) continue;
    std::reverse(followers.begin(), followers.end());
    std::vector<i64> wanted(followers.begin(), all ? followers.end() : followers.begin() + 1);
    auto conts = rows_of(ix, wanted, max_draft, true);
    int32_t first = conts[0].empty() ? -1 : conts[0][0];
    i64 agree = 0;
    for (i64 f : followers) agree += ix.tokens[f - ix.base] == first;
    return py::make_tuple(n, agree, (i64)followers.size(), conts);
  }
  return py::none();
}

// Token Recycling's tables as RecyclingDrafter holds them (array.array buffers): the successor matrix (k a row),
// and the tri-gram buckets' pair keys, next tokens and counts
struct RecyclingTables {
  py::buffer_info ai, ki, ni, ci;
  RecyclingTables(py::buffer adj, py::buffer key, py::buffer next, py::buffer count, bool writable)
      : ai(adj.request(writable)), ki(key.request(writable)), ni(next.request(writable)), ci(count.request(writable)) {
    if (ai.itemsize != 4 || ki.itemsize != 8 || ni.itemsize != 4 || ci.itemsize != 2)
      throw py::value_error("Token Recycling's tables: unexpected item sizes");
  }
  int32_t* adj() const { return (int32_t*)ai.ptr; }
  int64_t* keys() const { return (int64_t*)ki.ptr; }
  int32_t* next() const { return (int32_t*)ni.ptr; }
  uint16_t* counts() const { return (uint16_t*)ci.ptr; }
  i64 rows(i64 k) const { return (i64)ai.size / k; }
};

// a pair's tri-gram bucket and its key (RecyclingDrafter._slot)
static inline i64 tri_slot(i64 a, i64 b, i64 mask) { return (a * 1000003 + b * 7919) & mask; }
static inline i64 tri_key(i64 a, i64 b) { return (a << 32) | b; }

// Token Recycling's learning (RecyclingDrafter._move_to_front and _count_trigrams) on its own array.array tables,
// in place: each token from `mtf_lo` on moves to the front of its predecessor's row of `adj` (k successors a row);
// each tri-gram ending at a token from `tri_lo` on is counted in its pair's bucket (a negative lo: skipped)
static void recycling_learn(py::buffer adj_buf, i64 k, py::buffer key_buf, py::buffer next_buf, py::buffer count_buf,
                            i64 width, i64 mask, const std::vector<i64>& tokens, i64 mtf_lo, i64 tri_lo) {
  const RecyclingTables t(adj_buf, key_buf, next_buf, count_buf, true);
  int32_t* adj = t.adj();
  i64 rows = t.rows(k);
  i64 n = (i64)tokens.size();
  for (i64 i = std::max<i64>(mtf_lo, 1); mtf_lo >= 0 && i < n; ++i) {
    i64 prev = tokens[i - 1];
    if (prev < 0 || prev >= rows) throw py::value_error("recycling_learn: token beyond the matrix");
    int32_t* row = adj + prev * k;
    int32_t succ = (int32_t)tokens[i];
    if (row[0] == succ) continue;
    i64 j = k - 1;
    for (i64 x = 0; x < k; ++x) if (row[x] == succ) { j = x; break; }
    for (i64 x = j; x > 0; --x) row[x] = row[x - 1];
    row[0] = succ;
  }
  int64_t* keys = t.keys();
  int32_t* nxt = t.next();
  uint16_t* counts = t.counts();
  for (i64 i = std::max<i64>(tri_lo, 2); tri_lo >= 0 && i < n; ++i) {
    i64 a = tokens[i - 2], b = tokens[i - 1];
    int32_t c = (int32_t)tokens[i];
    i64 slot = tri_slot(a, b, mask), key = tri_key(a, b), base = slot * width, j;
    if (keys[slot] != key) {
      keys[slot] = key;
      for (i64 x = base; x < base + width; ++x) { nxt[x] = -1; counts[x] = 0; }
      j = base;
      nxt[j] = c;
    } else {
      j = -1;
      for (i64 x = base; x < base + width; ++x) if (nxt[x] == c) { j = x; break; }
      if (j < 0) {
        j = base;
        for (i64 x = base + 1; x < base + width; ++x) if (counts[x] < counts[j]) j = x;
        nxt[j] = c;
        counts[j] = 0;
      }
    }
    if (counts[j] == 65535)
      for (i64 x = base; x < base + width; ++x) counts[x] >>= 1;
    counts[j] += 1;
  }
}

// Token Recycling's draft (RecyclingDrafter._fill): the static tree `shape` ((parent, rank) per node, breadth
// first) filled from the pair (before, last): a node's token is its parent's successor of the node's rank, the
// successors of a pair ranked as RecyclingDrafter.ranked does (tri-grams seen at least `min_count` times, most
// counted first; the matrix row; the rarer tri-grams; no repeats). (tokens, parents, ranks, tri-gram counts)
static py::tuple recycling_fill(py::buffer adj_buf, i64 k, py::buffer key_buf, py::buffer next_buf,
                                py::buffer count_buf, i64 width, i64 mask, bool trigrams, i64 min_count,
                                i64 before, i64 last, const std::vector<std::pair<int, int>>& shape) {
  const RecyclingTables t(adj_buf, key_buf, next_buf, count_buf, false);
  const int32_t* adj = t.adj();
  const int64_t* keys = t.keys();
  const int32_t* nxt = t.next();
  const uint16_t* counts = t.counts();
  i64 rows = t.rows(k);
  auto ranked = [&](i64 a, i64 b, std::vector<std::pair<int32_t, i64>>& out) {
    out.clear();
    if (!trigrams) {                   // the matrix row as it is
      if (b >= 0 && b < rows)
        for (i64 j = 0; j < k; ++j) if (adj[b * k + j] >= 0) out.emplace_back(adj[b * k + j], 0);
      return;
    }
    std::vector<std::pair<int32_t, i64>> tri;
    if (a >= 0) {
      i64 slot = tri_slot(a, b, mask), base = slot * width;
      if (keys[slot] == tri_key(a, b))
        for (i64 x = base; x < base + width; ++x) if (counts[x] > 0) tri.emplace_back(nxt[x], (i64)counts[x]);
      std::stable_sort(tri.begin(), tri.end(), [](const auto& p, const auto& q) { return p.second > q.second; });
    }
    auto count_of = [&](int32_t t) -> i64 {
      for (const auto& p : tri) if (p.first == t) return p.second;
      return 0;
    };
    auto add = [&](int32_t t) {
      for (const auto& p : out) if (p.first == t) return;
      out.emplace_back(t, count_of(t));
    };
    for (const auto& p : tri) if (p.second >= min_count) add(p.first);
    if (b >= 0 && b < rows)
      for (i64 j = 0; j < k; ++j) if (adj[b * k + j] >= 0) add(adj[b * k + j]);
    for (const auto& p : tri) if (p.second < min_count) add(p.first);
  };
  std::vector<int32_t> tokens;
  std::vector<int> parents, ranks, node_of_shape;
  std::vector<i64> tri_counts;
  std::vector<std::pair<int32_t, i64>> succ;
  std::vector<std::tuple<i64, i64, std::vector<std::pair<int32_t, i64>>>> cache;
  for (const auto& [parent_shape, rank] : shape) {
    i64 a, b;
    int parent;
    if (parent_shape == -1) { a = before; b = last; parent = -1; }
    else {
      parent = node_of_shape[parent_shape];
      if (parent < 0) { node_of_shape.push_back(-1); continue; }
      int grand = parents[parent];
      a = grand >= 0 ? tokens[grand] : last;
      b = tokens[parent];
    }
    const std::vector<std::pair<int32_t, i64>>* found = nullptr;
    for (const auto& [ca, cb, cs] : cache) if (ca == a && cb == b) { found = &cs; break; }
    if (!found) {
      ranked(a, b, succ);
      cache.emplace_back(a, b, succ);
      found = &std::get<2>(cache.back());
    }
    if (rank >= (int)found->size()) { node_of_shape.push_back(-1); continue; }
    tokens.push_back((*found)[rank].first);
    tri_counts.push_back((*found)[rank].second);
    parents.push_back(parent);
    ranks.push_back(rank);
    node_of_shape.push_back((int)tokens.size() - 1);
  }
  return py::make_tuple(tokens, parents, ranks, tri_counts);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Index>(m, "Index")
      .def(py::init<std::vector<int>>())
      .def("extend", &Index::extend)
      .def("break_sequence", &Index::break_sequence)
      .def("occurrences", [](const Index& ix, const std::vector<int32_t>& key, i64 limit) {
        if (ix.slot((int)key.size()) < 0) throw py::value_error("this index holds no n-grams of that size");
        return ix.occurrences(key.data(), (int)key.size(), limit);
      })
      .def("evict_before", &Index::evict_before)
      .def("size", [](const Index& ix) { return ix.tokens.size(); })
      .def("end", &Index::end)
      .def("base", [](const Index& ix) { return ix.base; })
      .def("last", [](const Index& ix) { return ix.tokens.empty() ? (i64)-1 : (i64)ix.tokens.back(); })
      .def("tokens", [](const Index& ix) { return ix.tokens; })
      .def("sizes", [](const Index& ix) { return ix.sizes; })
      .def("grams", [](const Index& ix, int n) {
        std::vector<std::vector<int32_t>> out;
        int si = ix.slot(n);
        if (si >= 0)
          for (const auto& kv : ix.tables[si]) out.emplace_back(kv.first.t, kv.first.t + n);
        return out;
      });
  m.def("speculate", &speculate);
  m.def("draft", &draft);
  m.def("recycling_learn", &recycling_learn);
  m.def("ngram_match", &ngram_match);
  m.def("recycling_fill", &recycling_fill);
}
"""


@functools.lru_cache(maxsize=1)
def core():
    """The compiled module, or None where it cannot be built (the suffix drafter then keeps its Python code)."""
    from leapdecode.native import build
    return build("drafting", _SOURCE, None, flags=["-ffp-contract=off"])


class CompiledIndex:
    """:class:`~leapdecode.spec.index.NgramIndex`'s surface over the compiled index (see the module doc)."""

    def __init__(self, sizes: Sequence[int] = (1, 2, 3, 4)) -> None:
        mod = core()
        if mod is None:
            raise RuntimeError("the compiled suffix index could not be built")
        self.core = mod.Index(list(sizes))
        self.sizes: tuple[int, ...] = tuple(self.core.sizes())

    def __len__(self) -> int:
        return self.core.size()

    @property
    def base(self) -> int:
        return self.core.base()

    @property
    def end(self) -> int:
        return self.core.end()

    @property
    def last(self) -> int | None:
        """The last stored token (None when empty)."""
        return self.core.last() if self.core.size() else None

    @property
    def tokens(self) -> list[int]:
        """A copy of the stored tokens (from ``base`` on)."""
        return self.core.tokens()

    def extend(self, new_tokens: Sequence[int]) -> None:
        new = as_int_list(new_tokens)
        if new:
            self._extend(new)

    def _extend(self, new: list[int]) -> None:
        self.core.extend(new)

    def break_sequence(self) -> None:
        self.core.break_sequence()

    def occurrences(self, key: tuple[int, ...], limit: int | None = None) -> list[int]:
        return self.core.occurrences(list(key), -1 if limit is None else limit)

    def evict_before(self, position: int) -> None:
        self.core.evict_before(position)

    def grams(self, n: int) -> list[tuple[int, ...]]:
        """Every n-gram of size ``n`` held (for tests)."""
        return [tuple(g) for g in self.core.grams(n)]


__all__ = ["CompiledIndex", "core"]
