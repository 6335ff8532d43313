// The precision pass's three painting loops in C++ (issue 17):
// PrecisionPass._paint (list painting with the producers' vote), _demote
// (gray/clear nodes back to FP32 when that needs fewer casts) and
// _follow_readers (a clear node goes low before a fan-out), for the modes
// allow_mix_precision / allow_mix_precision_bf16.  The Python loops in
// graph_passes/precision/amp.py are the reference; this file runs the same
// decisions over integer arrays that graph_passes/precision/native.py builds
// (and documents) from the Python graph, and returns per node the decision as
// codes.  Python applies the re-typings and writes the report's reasons from
// them; tests/test_precision_native.py holds both paths byte-identical.
//
// No TensorFlow types are used here: the per-class facts (dtypes, lists,
// kernels, constant safety) come from Python, which owns them.
//
// Calls (ctypes, from npu_amp_tf/pipeline.py):
//   h = NpuAmpPaintOpen(strings, len, ints, n_ints)   parse; nullptr: refused
//   k = NpuAmpPaintRun(h, answered, unsafe, out, asked)  the loops; a float32
//       constant whose low-precision safety a loop asks and nobody answered
//       is taken as safe and listed in `asked`: Python answers those
//       (unsafe_const) and, when one is unsafe, runs the loops again (only
//       the constants the Python loops would ask are ever checked)
//   NpuAmpPaintClose(h)

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "name_table.h"  // npu_amp_tf::NameTable (no TensorFlow types)

namespace {

// TensorFlow DataType values (types.proto)
constexpr int32_t kF32 = 1;
constexpr int32_t kBf16 = 14;
constexpr int32_t kHalf = 19;
constexpr int32_t kRefOffset = 100;
constexpr int32_t kVersion = 3;

inline int32_t Base(int32_t dt) { return dt > kRefOffset ? dt - kRefOffset : dt; }
inline bool IsFloat(int32_t dt) { return dt == kF32 || dt == kHalf || dt == kBf16; }
inline bool IsLow(int32_t dt) { return dt == kHalf || dt == kBf16; }
// a float input wanted in `want` reading a float tensor of another dtype
// (`have` -1: unknown): the edges amp.py _fix_edges casts
inline bool Mismatch(int32_t want, int32_t have) {
  const int32_t w = Base(want);
  return IsFloat(w) && have >= 0 && IsFloat(Base(have)) && Base(have) != w;
}
inline uint64_t Bit(int32_t dt) { return (dt >= 0 && dt < 64) ? (uint64_t{1} << dt) : 0; }

// node flags (native.py)
constexpr int32_t kProtPaint = 1, kProt = 2, kKeep = 4, kForced = 8, kKernelLow = 16,
                  kKernelF32 = 32;
// class kinds
constexpr int32_t kKindOther = 0, kKindConst = 1, kKindCast = 2, kKindVariable = 3,
                  kKindThrough = 4;
// lists (lst codes)
constexpr int32_t kWhite = 1, kBlack = 2, kGray = 3, kClear = 4, kLstFixed = 5, kLstProt = 6,
                  kLstKeep = 7;
// states
constexpr int32_t kStNone = 0, kStLow = 1, kStF32 = 2, kStHard = 3, kStNeutral = 4,
                  kStFixed = 5;
// base reason codes
constexpr int32_t kRProt = 1, kRKeep = 2, kRForced = 3, kRWhite = 4, kRBlack = 5,
                  kRNeutral = 6, kRVoteLow = 7, kRVoteF32 = 8;
// output record
constexpr int kOutWidth = 18;
enum Out {
  kODecided = 0, kOTarget, kOState, kOBase, kOVoter, kORefuse, kORefuseConst, kOF32Fail,
  kODemoted, kODemoteF32, kODemoteLow, kOFollowed, kOGo, kOStay, kOContested, kOLst,
  kOMismatch, kOConstWants
};

struct Ref {
  int32_t src;   // node index, -1 when the name is no node
  int32_t port;  // -1 for a control input
  bool ctrl;
};

struct Csr {
  std::vector<int32_t> start;  // n + 1 offsets; count -1 -> start[i] = -1 marker via none
  std::vector<int32_t> vals;
  std::vector<char> none;
  int32_t Len(int32_t i) const { return none[i] ? -1 : start[i + 1] - start[i]; }
  const int32_t* At(int32_t i) const { return vals.data() + start[i]; }
};

// one node's inputs: a view of Painter::in_refs
struct RefSpan {
  const Ref* b;
  const Ref* e;
  const Ref* begin() const { return b; }
  const Ref* end() const { return e; }
  bool empty() const { return b == e; }
  size_t size() const { return static_cast<size_t>(e - b); }
  const Ref& operator[](size_t i) const { return b[i]; }
};

struct Reader {
  int32_t node;
  int32_t idx;
};

struct Painter {
  int32_t n = 0, k = 0, low = kHalf;
  std::vector<int32_t> order, cls, flags;
  // per class
  std::vector<int32_t> has_attrs, fixed, cur0, lst, kind;
  Csr fidx;
  Csr dts[3][2];  // [variant: original, FP32, low][0 inputs, 1 outputs]
  // per node: its inputs, in_refs[in_start[i] .. in_start[i + 1])
  std::vector<Ref> in_refs;
  std::vector<int32_t> in_start;
  RefSpan In(int32_t i) const {
    return RefSpan{in_refs.data() + in_start[i], in_refs.data() + in_start[i + 1]};
  }
  std::vector<int32_t> cons_start, cons_node, cons_idx, cons_port;  // data readers per source
  // (issue 17) kept for FixEdges: a copy of the strings, the names (ids =
  // node indices) and each input's text, as Python wrote it
  std::string text;
  npu_amp_tf::NameTable index;
  std::vector<std::string_view> ref_text;  // parallel to in_refs
  std::string fix_blob;                    // NpuAmpPaintFixEdges' answer
  std::shared_ptr<void> fix_plan;          // its CastPlan, for NpuAmpPaintDelayPlan
  std::vector<char> unsafe, unsafe_known;
  mutable std::vector<char> asked_seen;  // per run: the unanswered constants asked about
  mutable std::vector<int32_t> asked;
  // painting state
  std::vector<int32_t> cur, var, state, lst_out;
  std::vector<int32_t>* out = nullptr;

  bool FloatCast(int32_t i) const {  // a Cast between float dtypes (SrcT, DstT)
    const int32_t c = cls[i];
    if (kind[c] != kKindCast) return false;
    const Csr& in = dts[0][0];
    const Csr& o = dts[0][1];
    return in.Len(c) > 0 && o.Len(c) > 0 && IsFloat(in.At(c)[0]) && IsFloat(o.At(c)[0]);
  }

  // amp.py root(): through float->float Casts (at most 64)
  Ref Root(Ref r) const {
    for (int s = 0; s < 64; ++s) {
      if (r.src < 0) return r;
      if (kind[cls[r.src]] != kKindCast || In(r.src).empty()) return r;
      if (!FloatCast(r.src)) return r;
      r = In(r.src)[0];
    }
    return r;
  }

  const Csr& Outs(int32_t i) const { return dts[var[i]][1]; }
  const Csr& Ins(int32_t i) const { return dts[var[i]][0]; }

  // tensor_dtype(ref): base dtype or -1
  int32_t TensorDtype(const Ref& r) const {
    if (r.ctrl || r.src < 0) return -1;
    const Csr& o = Outs(r.src);
    const int32_t len = o.Len(cls[r.src]);
    if (len < 0 || r.port >= len) return -1;
    return o.At(cls[r.src])[r.port];
  }

  // amp.py _const_of: a Const through casts / identities, or -1
  int32_t ConstOf(Ref r) const {
    for (int s = 0; s < 16; ++s) {
      r = Root(r);
      if (r.src < 0) return -1;
      const int32_t kd = kind[cls[r.src]];
      if (kd == kKindConst) return r.src;
      if (kd == kKindThrough && !In(r.src).empty()) {
        r = In(r.src)[0];
        continue;
      }
      return -1;
    }
    return -1;
  }

  bool ConstFloat(int32_t c) const {
    const Csr& o = dts[0][1];
    return o.Len(cls[c]) > 0 && IsFloat(o.At(cls[c])[0]);
  }
  bool ConstF32(int32_t c) const {
    const Csr& o = dts[0][1];
    return o.Len(cls[c]) > 0 && o.At(cls[c])[0] == kF32;
  }

  template <typename F>
  void FloatInputs(int32_t i, F f) const {
    const int32_t c = cls[i];
    const int32_t len = fidx.Len(c);
    if (len <= 0) return;
    const int32_t* p = fidx.At(c);
    const RefSpan ins = In(i);
    for (int32_t j = 0; j < len; ++j) {
      const int32_t kk = p[j];
      if (kk >= static_cast<int32_t>(ins.size()) || ins[kk].ctrl) continue;
      if (!f(ins[kk])) return;
    }
  }

  // readers of tensor (s, p) through float Casts (amp.py _readers_of), not `exclude`
  void Readers(int32_t s, int32_t p, int32_t exclude, std::vector<Reader>* acc, int depth) const {
    if (s < 0 || depth > 64) return;
    for (int32_t e = cons_start[s]; e < cons_start[s + 1]; ++e) {
      if (cons_port[e] != p) continue;
      const int32_t c = cons_node[e];
      if (c == exclude) continue;
      if (FloatCast(c)) {
        Readers(c, 0, exclude, acc, depth + 1);
      } else {
        acc->push_back({c, cons_idx[e]});
      }
    }
  }

  uint64_t Wanted(int32_t s, int32_t p, int32_t exclude) const {
    std::vector<Reader> rs;
    Readers(s, p, exclude, &rs, 0);
    uint64_t m = 0;
    for (const Reader& r : rs) {
      const Csr& in = Ins(r.node);
      const int32_t len = in.Len(cls[r.node]);
      if (len >= 0 && r.idx < len) m |= Bit(Base(in.At(cls[r.node])[r.idx]));
    }
    return m;
  }

  uint64_t DirectWants(int32_t s, int32_t p) const {
    uint64_t m = 0;
    for (int32_t e = cons_start[s]; e < cons_start[s + 1]; ++e) {
      if (cons_port[e] != p) continue;
      const int32_t c = cons_node[e];
      const Csr& in = Ins(c);
      const int32_t len = in.Len(cls[c]);
      if (len >= 0 && cons_idx[e] < len) m |= Bit(Base(in.At(cls[c])[cons_idx[e]]));
    }
    return m;
  }

  int32_t NumOuts(int32_t i) const {
    const int32_t len = Outs(i).Len(cls[i]);
    return len < 0 ? 0 : len;
  }

  void Retype(int32_t i, int32_t dt) {
    cur[i] = dt;
    var[i] = dt == kF32 ? 1 : 2;
  }

  int32_t* Rec(int32_t i) { return out->data() + static_cast<size_t>(i) * kOutWidth; }

  // amp.py _refuse_low: 0 none, 1 unsafe const (its index in *cidx), 2 no kernel
  int RefuseLow(int32_t i, int32_t* cidx) const {
    int res = 0;
    FloatInputs(i, [&](const Ref& r) {
      const int32_t c = ConstOf(r);
      if (c >= 0 && ConstFloat(c)) {
        if (!unsafe_known[c] && ConstF32(c)) {
          // not answered yet: taken as safe, and asked (the caller answers
          // and runs the loops again if it is not)
          if (!asked_seen[c]) {
            asked_seen[c] = 1;
            asked.push_back(c);
          }
        } else if (unsafe[c]) {
          *cidx = c;
          res = 1;
          return false;
        }
      }
      return true;
    });
    if (res) return res;
    if (!(flags[i] & kKernelLow)) return 2;
    return 0;
  }

  // _to_fp32: target FP32 (or cur and state fixed when no FP32 kernel)
  void ToF32(int32_t i, int32_t st, int32_t* target, int32_t* state) {
    if (cur[i] == kF32 || (flags[i] & kKernelF32)) {
      *target = kF32;
      *state = st;
      return;
    }
    Rec(i)[kOF32Fail] = 1;
    *target = cur[i];
    *state = kStFixed;
  }

  void WantLow(int32_t i, int32_t* target, int32_t* state) {
    if (cur[i] != low) {
      int32_t c = -1;
      const int why = RefuseLow(i, &c);
      if (why) {
        Rec(i)[kORefuse] = why;
        Rec(i)[kORefuseConst] = c;
        ToF32(i, kStHard, target, state);
        return;
      }
    }
    *target = low;
    *state = kStLow;
  }

  void Paint() {
    for (int32_t i : order) {
      const int32_t c = cls[i];
      if (!has_attrs[c] || kind[c] == kKindConst) continue;
      int32_t* rec = Rec(i);
      if (fixed[c]) {
        state[i] = kStFixed;
        lst_out[i] = kLstFixed;
        rec[kODecided] = 1;
        rec[kOTarget] = cur[i];
        rec[kOState] = kStFixed;
        rec[kOLst] = kLstFixed;
        continue;
      }
      rec[kODecided] = 2;
      const int32_t cu = cur[i];
      int32_t target = cu, st = kStF32, base = 0, l = lst[c];
      const int32_t f = flags[i];
      if (f & kProtPaint) {
        st = IsLow(cu) ? kStLow : kStF32;
        base = kRProt;
        l = kLstProt;
      } else if (f & kKeep) {
        st = IsLow(cu) ? kStLow : kStHard;
        base = kRKeep;
        l = kLstKeep;
      } else if (f & kForced) {
        base = kRForced;
        WantLow(i, &target, &st);
      } else if (l == kWhite) {
        base = kRWhite;
        WantLow(i, &target, &st);
      } else if (l == kBlack) {
        base = kRBlack;
        ToF32(i, kStHard, &target, &st);
      } else {
        int32_t n_low = 0, n_f32 = 0, first_low = -1, first_f32 = -1;
        bool hard = false;
        FloatInputs(i, [&](const Ref& in) {
          // _voter_fast
          Ref r = in;
          for (int s = 0; s < 64; ++s) {
            if (r.src < 0) return true;
            if (kind[cls[r.src]] != kKindCast || In(r.src).empty()) break;
            if (!FloatCast(r.src)) break;
            r = In(r.src)[0];
          }
          if (r.src < 0) return true;
          const int32_t kd = kind[cls[r.src]];
          if (kd == kKindConst || kd == kKindVariable || kd == kKindCast) return true;
          const int32_t sst = state[r.src];
          if (sst == kStNeutral || r.ctrl) return true;
          const int32_t dt0 = TensorDtype(r);
          if (dt0 < 0) return true;
          const int32_t dt = Base(dt0);
          if (!IsFloat(dt)) return true;
          if (IsLow(dt)) {
            ++n_low;
            if (first_low < 0) first_low = r.src;
          } else {
            ++n_f32;
            hard = hard || (sst == kStHard && dt == kF32);
            if (first_f32 < 0) first_f32 = r.src;
          }
          return true;
        });
        if (n_low == 0 && n_f32 == 0) {
          base = kRNeutral;
          st = kStNeutral;
        } else if (n_low > n_f32 || (n_low == n_f32 && !hard)) {
          if (n_f32) rec[kOContested] = 1;
          base = kRVoteLow;
          rec[kOVoter] = first_low;
          WantLow(i, &target, &st);
        } else {
          base = kRVoteF32;
          rec[kOVoter] = first_f32;
          ToF32(i, hard ? kStHard : kStF32, &target, &st);
        }
      }
      if (target != cu) Retype(i, target);
      state[i] = st;
      lst_out[i] = l;
      rec[kOTarget] = target;
      rec[kOState] = st;
      rec[kOBase] = base;
      rec[kOLst] = l;
    }
  }

  bool Movable(int32_t i) const {
    bool seen = false, ok = true;
    FloatInputs(i, [&](const Ref& in) {
      const Ref r = Root(in);
      const int32_t dt = TensorDtype(r);
      if (dt < 0 || Base(dt) != low) return true;
      const int32_t d = r.src >= 0 ? Rec2(r.src) : 0;
      if (!d || (lst_out[r.src] != kGray && lst_out[r.src] != kClear)) {
        ok = false;
        return false;
      }
      seen = true;
      return true;
    });
    return ok && seen;
  }
  int32_t Rec2(int32_t i) const { return (*out)[static_cast<size_t>(i) * kOutWidth + kODecided]; }

  void Demote() {
    for (auto it = order.rbegin(); it != order.rend(); ++it) {
      const int32_t i = *it;
      int32_t* rec = Rec(i);
      if (rec[kODecided] != 2 || state[i] != kStLow) continue;
      const int32_t l = lst_out[i];
      if (l != kGray && l != kClear) continue;
      if (flags[i] & kForced) continue;
      int32_t cost_low = 0, cost_f32 = 0;
      FloatInputs(i, [&](const Ref& in) {
        const Ref r = Root(in);
        if (r.src < 0 || kind[cls[r.src]] == kKindConst) return true;
        const int32_t dt0 = TensorDtype(r);
        const int32_t rdt = dt0 < 0 ? -1 : Base(dt0);
        if (rdt == kF32 && !(Wanted(r.src, r.port, i) & Bit(low))) {
          ++cost_low;
        } else if (rdt == low && !(Wanted(r.src, r.port, i) & Bit(kF32))) {
          ++cost_f32;
        }
        return true;
      });
      uint64_t outs = 0;
      const int32_t no = NumOuts(i);
      for (int32_t p = 0; p < no; ++p) outs |= Wanted(i, p, -1);
      cost_low += (outs & Bit(kF32)) ? 1 : 0;
      cost_f32 += (outs & Bit(low)) ? 1 : 0;
      const bool edge_tie = cost_f32 == cost_low && outs == Bit(kF32) &&
                            (rec[kOContested] || (l == kClear && Movable(i)));
      if (cost_f32 < cost_low || edge_tie) {
        Retype(i, kF32);
        state[i] = kStF32;
        rec[kODemoted] = 1;
        rec[kODemoteF32] = cost_f32;
        rec[kODemoteLow] = cost_low;
      }
    }
  }

  void Follow() {
    for (auto it = order.rbegin(); it != order.rend(); ++it) {
      const int32_t i = *it;
      int32_t* rec = Rec(i);
      if (!rec[kODecided] || lst_out[i] != kClear) continue;
      const int32_t st = state[i];
      if (st != kStNeutral && st != kStF32 && st != kStHard) continue;
      if (flags[i] & (kKeep | kProt)) continue;
      if (cur[i] != kF32) continue;
      int32_t stay = 0, go = 0;
      const int32_t no = NumOuts(i);
      for (int32_t p = 0; p < no; ++p) {
        const uint64_t w = DirectWants(i, p);
        stay += (w & Bit(low)) ? 1 : 0;
        go += (w & Bit(kF32)) ? 1 : 0;
      }
      if (!stay) continue;
      bool blocked = false;
      FloatInputs(i, [&](const Ref& in) {
        const Ref r = Root(in);
        if (r.src < 0 || kind[cls[r.src]] == kKindVariable) {
          blocked = true;
          return false;
        }
        if (ConstOf(in) >= 0) return true;
        if (in.src >= 0 && kind[cls[in.src]] == kKindCast) {
          const int32_t pc = cls[in.src];
          const Csr& pin = dts[0][0];
          const Csr& pout = dts[0][1];
          // attr DstT == low and SrcT float (a missing attr reads 0)
          const int32_t dst = pout.Len(pc) > 0 ? pout.At(pc)[0] : 0;
          const int32_t src = pin.Len(pc) > 0 ? pin.At(pc)[0] : 0;
          if (dst == low && IsFloat(src)) return true;
        }
        const int32_t dt0 = TensorDtype(r);
        if (dt0 >= 0 && Base(dt0) == kF32 && !(Wanted(r.src, r.port, i) & Bit(low))) ++go;
        return true;
      });
      if (blocked || go >= stay) continue;
      int32_t cidx = -1;
      if (RefuseLow(i, &cidx)) continue;
      Retype(i, low);
      state[i] = kStLow;
      rec[kOFollowed] = 1;
      rec[kOGo] = go;
      rec[kOStay] = stay;
    }
  }

  // (issue 17n) after the loops: a node with a float data input whose dtype
  // differs from the float dtype the node wants there (amp.py _fix_edges'
  // test, over the dtypes the loops leave).  The steps between the loops and
  // _fix_edges (_adapt_casts, _convert_consts) only re-type a Cast or a
  // Const to what its readers want or its producer gives, so they remove
  // mismatches and never add one: _fix_edges need visit only these nodes.
  // (issue 17t, format 3) The record holds which inputs: bit k for input
  // k < 30, bit 30 for "some input at 30 or later" (Python then checks
  // every input from 30 on); 0: none.
  void Mismatches() {
    for (int32_t i = 0; i < n; ++i) {
      const Csr& in = Ins(i);
      const int32_t len = in.Len(cls[i]);
      if (len <= 0) continue;
      const int32_t* want = in.At(cls[i]);
      const RefSpan ins = In(i);
      const int32_t m = std::min<int32_t>(len, static_cast<int32_t>(ins.size()));
      for (int32_t k = 0; k < m; ++k) {
        const Ref& r = ins[k];
        if (!r.ctrl && Mismatch(want[k], TensorDtype(r))) {
          Rec(i)[kOMismatch] |= k < 30 ? (1 << k) : (1 << 30);
        }
      }
    }
  }

  // (issue 17n) per Const, the base dtypes its data readers of output 0
  // want, after the loops (amp.py _consumer_wants, for _convert_consts): a
  // bit mask of dtypes, or -1 when Python must ask itself (a reader whose
  // input dtypes are unknown or shorter, a Cast reader: _adapt_casts may
  // re-type its SrcT before _convert_consts, a dtype past bit 30)
  void ConstWants() {
    for (int32_t i = 0; i < n; ++i) {
      if (kind[cls[i]] != kKindConst) continue;
      int64_t m = 0;
      for (int32_t e = cons_start[i]; e < cons_start[i + 1]; ++e) {
        if (cons_port[e] != 0) continue;
        const int32_t c = cons_node[e];
        const Csr& in = Ins(c);
        const int32_t len = in.Len(cls[c]);
        if (kind[cls[c]] == kKindCast || len < 0 || cons_idx[e] >= len) {
          m = -1;
          break;
        }
        const int32_t dt = Base(in.At(cls[c])[cons_idx[e]]);
        if (dt < 0 || dt > 30) {
          m = -1;
          break;
        }
        m |= int64_t{1} << dt;
      }
      Rec(i)[kOConstWants] = static_cast<int32_t>(m);
    }
  }
};

// ------------------------------------------------------------------ parsing
struct IntReader {
  const int32_t* p;
  int64_t left;
  bool ok = true;
  int32_t One() {
    if (left <= 0) {
      ok = false;
      return 0;
    }
    --left;
    return *p++;
  }
  // a length-prefixed section
  bool Section(std::vector<int32_t>* v) {
    const int32_t len = One();
    if (!ok || len < 0 || len > left) return ok = false;
    v->assign(p, p + len);
    p += len;
    left -= len;
    return true;
  }
};

// counts (-1 = none) then values
bool ReadCsr(IntReader* r, int32_t k, Csr* csr) {
  std::vector<int32_t> counts, vals;
  if (!r->Section(&counts) || !r->Section(&vals) || static_cast<int32_t>(counts.size()) != k) {
    return false;
  }
  csr->start.assign(k + 1, 0);
  csr->none.assign(k, 0);
  int64_t acc = 0;
  for (int32_t c = 0; c < k; ++c) {
    csr->start[c] = static_cast<int32_t>(acc);
    if (counts[c] < 0) {
      csr->none[c] = 1;
    } else {
      acc += counts[c];
    }
  }
  csr->start[k] = static_cast<int32_t>(acc);
  if (acc != static_cast<int64_t>(vals.size())) return false;
  csr->vals = std::move(vals);
  return true;
}

bool ParsePort(std::string_view s, int32_t* port) {
  if (s.empty() || s.size() > 9) return false;
  int32_t v = 0;
  for (char ch : s) {
    if (ch < '0' || ch > '9') return false;
    v = v * 10 + (ch - '0');
  }
  *port = v;
  return true;
}

// ------------------------------------------------ the casts on mismatched edges
// (issue 17, the C++ core's milestone 2) amp.py PrecisionPass._fix_edges_bulk's
// decisions, over the painter's graph: every float data input whose dtype
// differs from the float dtype its node wants gets a tensor of that dtype:
// the root behind float->float Casts when it has it, else a Cast already
// reading the root (the first by name), else a new Cast named
// "<src>/CastToXx[_port]" (a "_j" suffix when taken), one per (root, dtype).
// Python keeps the reference and applies the plan (NodeDefs, the index).
//
// The dtypes are those Python applied from the result record `o` (a copy of
// the painting's output, as Python read it: the painted target, then FP32 for
// a demotion, then the low dtype for a follow-up), with `overrides` for the
// nodes re-typed since (_adapt_casts, _convert_consts), which also count as
// touched.  `ctrl_casts`: the Casts with a control input (never reused).
class CastPlan {
 public:
  explicit CastPlan(const Painter& p) : p_(p), var_(p.n, 0), ov_at_(p.n, -1), touched_(p.n, 0) {}

  // false: arguments that do not describe the graph
  bool Load(const int32_t* o, const int32_t* ints, int64_t n_ints) {
    const int32_t n = p_.n;
    for (int32_t i = 0; i < n; ++i) {
      const int32_t* r = o + static_cast<size_t>(i) * kOutWidth;
      if (r[kODecided] != 2) continue;
      const int32_t c = p_.cls[i];
      int32_t fin = r[kOTarget];
      bool moved = fin != p_.cur0[c];
      if (r[kODemoted]) fin = kF32, moved = true;
      if (r[kOFollowed]) fin = p_.low, moved = true;
      if (moved) touched_[i] = 1;
      var_[i] = fin == p_.cur0[c] ? 0 : fin == kF32 ? 1 : IsLow(fin) ? 2 : 0;
    }
    IntReader rd{ints, n_ints};
    const int32_t n_ov = rd.One();
    if (!rd.ok || n_ov < 0) return false;
    ov_.resize(n_ov);
    for (int32_t j = 0; j < n_ov; ++j) {
      const int32_t i = rd.One();
      if (!rd.ok || i < 0 || i >= n) return false;
      Ov& v = ov_[j];
      if (!ReadDts(&rd, &v.nin, &v.ins) || !ReadDts(&rd, &v.nout, &v.outs)) return false;
      ov_at_[i] = j;
      touched_[i] = 1;
    }
    const int32_t n_ctrl = rd.One();
    if (!rd.ok || n_ctrl < 0) return false;
    ctrl_.assign(n, 0);
    for (int32_t j = 0; j < n_ctrl; ++j) {
      const int32_t i = rd.One();
      if (!rd.ok || i < 0 || i >= n) return false;
      ctrl_[i] = 1;
    }
    mism_ = o;
    return rd.ok && rd.left == 0;
  }

  // the plan as Python reads it (see NpuAmpPaintFixEdges); false: a form
  // left to Python (a root of unknown dtype needing a cast)
  bool Run(std::string* blob) {
    const int32_t n = p_.n;
    std::vector<int32_t> news, steps, saves;  // (src, SrcT, DstT), (new, node, k), node
    std::vector<std::string_view> step_refs;
    struct Key {
      std::string_view root;
      int32_t dt;
      bool operator==(const Key& o) const { return dt == o.dt && root == o.root; }
    };
    struct KeyHash {
      size_t operator()(const Key& k) const {
        return npu_amp_tf::NameTable::Hash(k.root) * 31 + static_cast<size_t>(k.dt);
      }
    };
    struct Target {
      std::string_view ref;
      int32_t id;  // the node the reference names: a painted node, or n + a new cast
    };
    std::unordered_map<Key, Target, KeyHash> cache;
    std::unordered_set<std::string_view> taken;
    for (int32_t i = 0; i < n; ++i) {
      const int32_t bits = mism_[static_cast<size_t>(i) * kOutWidth + kOMismatch];
      if (!bits) continue;
      const RefSpan ins = p_.In(i);
      bool visit = touched_[i] != 0;
      for (size_t k = 0; !visit && k < ins.size(); ++k) {
        visit = !ins[k].ctrl && ins[k].src >= 0 && touched_[ins[k].src];
      }
      if (!visit) continue;
      const int32_t* want;
      const int32_t len = InsOf(i, &want);
      if (len < 0) continue;
      const int32_t m = std::min<int32_t>(len, static_cast<int32_t>(ins.size()));
      for (int32_t k = 0; k < m; ++k) {
        if (k < 30 ? !(bits >> k & 1) : !(bits >> 30 & 1)) continue;
        const size_t e = static_cast<size_t>(p_.in_start[i]) + k;
        const Ref& r = p_.in_refs[e];
        const int32_t have = r.ctrl ? -1 : DtypeOf(r);
        if (r.ctrl || !Mismatch(want[k], have)) continue;
        const int32_t w = Base(want[k]);
        const std::string_view inp = p_.ref_text[e];
        const size_t re = RootEdge(e);
        const std::string_view root = p_.ref_text[re];
        const Ref& rr = p_.in_refs[re];
        const int32_t rdt = root == inp ? have : DtypeOf(rr);
        int32_t nj = -1, tgt = rr.src;
        std::string_view ref;
        if (rdt >= 0 && Base(rdt) == w) {
          ref = root;
        } else {
          const Key key{root, w};
          auto hit = cache.find(key);
          if (hit != cache.end()) {
            ref = hit->second.ref;
            tgt = hit->second.id;
          } else {
            if (rdt < 0 || rr.src < 0) return false;
            const int32_t found = ExistingCast(rr, w, Base(rdt));
            if (found >= 0) {
              ref = p_.index.key(found);
              tgt = found;
            } else {
              std::string base(p_.index.key(rr.src));
              base += w == kHalf ? "/CastToFp16" : w == kBf16 ? "/CastToBf16" : "/CastToFp32";
              if (rr.port) base += "_" + std::to_string(rr.port);
              std::string name = base;
              for (int j = 1; p_.index.Find(name) >= 0 || taken.count(name); ++j) {
                name = base + "_" + std::to_string(j);
              }
              names_.push_back(std::move(name));
              ref = names_.back();
              taken.insert(ref);
              nj = static_cast<int32_t>(news.size() / 3);
              news.insert(news.end(), {rr.src, Base(rdt), w});
              new_roots_.push_back(root);
              tgt = n + nj;
            }
            cache.emplace(key, Target{ref, tgt});
          }
        }
        saves.push_back(i);
        if (nj >= 0 || ref != inp) {
          steps.insert(steps.end(), {nj, i, k});
          step_refs.push_back(ref);
          step_tgt_.push_back(tgt);
        }
      }
    }
    news_ = news;
    steps_ = steps;
    // ints: counts, news, steps, saves; then the text: new names \x01-joined,
    // \x02, their roots, \x02, the steps' references
    std::vector<int32_t> head = {static_cast<int32_t>(news.size() / 3),
                                 static_cast<int32_t>(steps.size() / 3),
                                 static_cast<int32_t>(saves.size())};
    blob->clear();
    for (const std::vector<int32_t>* v : {&head, &news, &steps, &saves}) {
      blob->append(reinterpret_cast<const char*>(v->data()), v->size() * sizeof(int32_t));
    }
    for (size_t j = 0; j < names_.size(); ++j) {
      if (j) blob->push_back('\x01');
      blob->append(names_[j]);
    }
    blob->push_back('\x02');
    for (size_t j = 0; j < new_roots_.size(); ++j) {
      if (j) blob->push_back('\x01');
      blob->append(new_roots_[j]);
    }
    blob->push_back('\x02');
    for (size_t j = 0; j < step_refs.size(); ++j) {
      if (j) blob->push_back('\x01');
      blob->append(step_refs[j]);
    }
    return true;
  }

  // (issue 17) amp.py _delay_widening_casts' plan over the graph as this
  // plan leaves it (after Run): `pos` the Kahn position of every node, the
  // painted ones then the new casts (n + j).  Per new FP32 copy of a low
  // tensor (creation order) that nothing awaits, the producers it waits for:
  // the other inputs of its readers placed after its source and before its
  // first reader (not a Const, not a delayed copy, each once); a copy that
  // waits takes the place just before its first reader.  `*forward`: every
  // edge into and out of the copies that wait (their waits included) goes
  // forward in the positions so updated (amp.py _forward_at: no cycle).
  // The plan: per copy that waits, its index, the count of waits, the waits.
  void Delay(const int32_t* pos_in, std::vector<int32_t>* plan, bool* forward) const {
    const int32_t n = p_.n;
    const int32_t nn = static_cast<int32_t>(news_.size() / 3);
    std::vector<double> pos(pos_in, pos_in + n + nn);
    // the steps by new cast (its readers, in the order they were re-wired),
    // and every re-wired input's target
    std::vector<std::vector<int32_t>> readers(nn);  // step indices
    std::unordered_map<int64_t, int32_t> rewired;
    const size_t ns = steps_.size() / 3;
    for (size_t t = 0; t < ns; ++t) {
      const int32_t node = steps_[3 * t + 1], k = steps_[3 * t + 2], tgt = step_tgt_[t];
      rewired[(static_cast<int64_t>(node) << 32) | static_cast<uint32_t>(k)] = tgt;
      if (tgt >= n) readers[tgt - n].push_back(static_cast<int32_t>(t));
    }
    auto is_const = [&](int32_t id) { return id >= 0 && id < n && p_.kind[p_.cls[id]] == kKindConst; };
    std::vector<char> awaited(n + nn, 0), delayed(n + nn, 0);
    std::vector<int32_t> moved;
    *forward = true;
    for (int32_t j = 0; j < nn; ++j) {
      const int32_t id = n + j, src = news_[3 * j], src_t = news_[3 * j + 1], dst_t = news_[3 * j + 2];
      if (awaited[id] || dst_t != kF32 || !IsLow(src_t)) continue;
      if (is_const(src) || readers[j].empty()) continue;
      double first = 0;
      bool any = false;
      for (int32_t t : readers[j]) {
        const double q = pos[steps_[3 * t + 1]];
        first = any ? std::min(first, q) : q;
        any = true;
      }
      std::vector<int32_t> waits;
      for (int32_t t : readers[j]) {
        const int32_t reader = steps_[3 * t + 1], idx = steps_[3 * t + 2];
        const RefSpan ins = p_.In(reader);
        for (size_t k = 0; k < ins.size(); ++k) {
          if (static_cast<int32_t>(k) == idx || ins[k].ctrl) continue;
          auto rw = rewired.find((static_cast<int64_t>(reader) << 32) | static_cast<uint32_t>(k));
          const int32_t other = rw != rewired.end() ? rw->second : ins[k].src;
          if (other < 0 || delayed[other] || is_const(other)) continue;
          if (std::find(waits.begin(), waits.end(), other) != waits.end()) continue;
          if (pos[src] < pos[other] && pos[other] < first) waits.push_back(other);
        }
      }
      if (waits.empty()) continue;
      pos[id] = first - 0.5;
      delayed[id] = 1;
      for (int32_t w : waits) awaited[w] = 1;
      moved.push_back(j);
      plan->push_back(j);
      plan->push_back(static_cast<int32_t>(waits.size()));
      plan->insert(plan->end(), waits.begin(), waits.end());
    }
    // _forward_at: the copy's inputs (its source, its waits) before it, its
    // readers after it
    for (size_t a = 0, at = 0; a < moved.size(); ++a) {
      const int32_t j = moved[a];
      const double p = pos[n + j];
      const int32_t nw = (*plan)[at + 1];
      bool ok = pos[news_[3 * j]] < p;
      for (int32_t w = 0; ok && w < nw; ++w) ok = pos[(*plan)[at + 2 + w]] < p;
      for (int32_t t : readers[j]) ok = ok && pos[steps_[3 * t + 1]] > p;
      at += 2 + nw;
      if (!ok) {
        *forward = false;
        break;
      }
    }
  }

  int32_t new_count() const { return static_cast<int32_t>(news_.size() / 3); }

 private:
  struct Ov {
    int32_t nin = -1, nout = -1;
    std::vector<int32_t> ins, outs;
  };

  static bool ReadDts(IntReader* rd, int32_t* count, std::vector<int32_t>* vals) {
    *count = rd->One();
    if (!rd->ok || *count < -1 || *count > rd->left) return false;
    for (int32_t j = 0; j < *count; ++j) vals->push_back(rd->One());
    return rd->ok;
  }

  // node i's input (side 0) or output (side 1) dtypes now: (values, count; -1 unknown)
  int32_t DtsOf(int32_t i, int side, const int32_t** v) const {
    if (ov_at_[i] >= 0) {
      const Ov& o = ov_[ov_at_[i]];
      *v = side ? o.outs.data() : o.ins.data();
      return side ? o.nout : o.nin;
    }
    const Csr& c = p_.dts[var_[i]][side];
    *v = c.At(p_.cls[i]);
    return c.Len(p_.cls[i]);
  }
  int32_t InsOf(int32_t i, const int32_t** v) const { return DtsOf(i, 0, v); }
  int32_t OutsOf(int32_t i, const int32_t** v) const { return DtsOf(i, 1, v); }
  // tensor_dtype: the dtype (ref types included) or -1
  int32_t DtypeOf(const Ref& r) const {
    if (r.ctrl || r.src < 0) return -1;
    const int32_t* v;
    const int32_t len = OutsOf(r.src, &v);
    return len < 0 || r.port >= len ? -1 : v[r.port];
  }
  // amp.py root(): the input (an index of in_refs) behind float->float Casts
  size_t RootEdge(size_t e) const {
    for (int s = 0; s < 64; ++s) {
      const Ref& r = p_.in_refs[e];
      if (r.src < 0 || p_.kind[p_.cls[r.src]] != kKindCast || p_.In(r.src).empty()) return e;
      const int32_t *si, *so;
      if (InsOf(r.src, &si) < 1 || OutsOf(r.src, &so) < 1) return e;
      if (!IsFloat(si[0]) || !IsFloat(so[0])) return e;
      e = static_cast<size_t>(p_.in_start[r.src]);
    }
    return e;
  }
  // the first (by name) Cast reading `r` at its input 0 with DstT `w`,
  // SrcT `src_t` and no control input, or -1
  int32_t ExistingCast(const Ref& r, int32_t w, int32_t src_t) const {
    int32_t best = -1;
    for (int32_t e = p_.cons_start[r.src]; e < p_.cons_start[r.src + 1]; ++e) {
      if (p_.cons_port[e] != r.port || p_.cons_idx[e] != 0) continue;
      const int32_t c = p_.cons_node[e];
      if (p_.kind[p_.cls[c]] != kKindCast || ctrl_[c]) continue;
      const int32_t *si, *so;
      if (InsOf(c, &si) < 1 || OutsOf(c, &so) < 1 || so[0] != w || si[0] != src_t) continue;
      if (best < 0 || p_.index.key(c) < p_.index.key(best)) best = c;
    }
    return best;
  }

  const Painter& p_;
  std::vector<int32_t> var_, ov_at_;
  std::vector<char> touched_, ctrl_;
  std::vector<Ov> ov_;
  const int32_t* mism_ = nullptr;
  std::deque<std::string> names_;  // the new casts' names (stable storage)
  std::vector<std::string_view> new_roots_;
  // after Run: the new casts (source, SrcT, DstT), the steps (new cast or -1,
  // node, input) and each step's target (a painted node, or n + a new cast)
  std::vector<int32_t> news_, steps_, step_tgt_;
};

Painter* Open(const char* strings, size_t len, const int32_t* ints, int64_t n_ints) {
  auto* pt = new Painter();
  IntReader r{ints, n_ints};
  const int32_t version = r.One();
  pt->n = r.One();
  pt->k = r.One();
  pt->low = r.One();
  if (!r.ok || version != kVersion || pt->n < 0 || pt->k < 0 || !IsLow(pt->low)) {
    delete pt;
    return nullptr;
  }
  const int32_t n = pt->n, k = pt->k;
  std::vector<int32_t> rec;
  bool ok = r.Section(&pt->order) && r.Section(&pt->cls) && r.Section(&pt->flags) &&
            r.Section(&rec) && ReadCsr(&r, k, &pt->fidx);
  for (int v = 0; ok && v < 3; ++v) {
    ok = ReadCsr(&r, k, &pt->dts[v][0]) && ReadCsr(&r, k, &pt->dts[v][1]);
  }
  ok = ok && static_cast<int32_t>(pt->cls.size()) == n &&
       static_cast<int32_t>(pt->flags.size()) == n && rec.size() == static_cast<size_t>(k) * 5;
  for (int32_t i = 0; ok && i < n; ++i) ok = pt->cls[i] >= 0 && pt->cls[i] < k;
  for (int32_t i : pt->order) ok = ok && i >= 0 && i < n;
  if (!ok) {
    delete pt;
    return nullptr;
  }
  pt->has_attrs.resize(k);
  pt->fixed.resize(k);
  pt->cur0.resize(k);
  pt->lst.resize(k);
  pt->kind.resize(k);
  for (int32_t c = 0; c < k; ++c) {
    pt->has_attrs[c] = rec[5 * c];
    pt->fixed[c] = rec[5 * c + 1];
    pt->cur0[c] = rec[5 * c + 2];
    pt->lst[c] = rec[5 * c + 3];
    pt->kind[c] = rec[5 * c + 4];
  }
  // strings: names joined by \x01, \x03, then per node its inputs joined by
  // \x01, nodes joined by \x02
  pt->text.assign(strings, len);
  std::string_view all(pt->text);
  const size_t sep = all.find('\x03');
  if (sep == std::string_view::npos) {
    delete pt;
    return nullptr;
  }
  std::string_view names = all.substr(0, sep), ins = all.substr(sep + 1);
  npu_amp_tf::NameTable& index = pt->index;
  index.Reserve(static_cast<size_t>(n));
  {
    size_t pos = 0;
    for (int32_t i = 0; i < n; ++i) {
      size_t end = names.find('\x01', pos);
      if (end == std::string_view::npos) end = names.size();
      if (!index.Insert(names.substr(pos, end - pos))) {  // (names are unique in the Python graph)
        delete pt;
        return nullptr;
      }
      pos = end + 1;
    }
  }
  pt->in_start.assign(static_cast<size_t>(n) + 1, 0);
  pt->in_refs.reserve(static_cast<size_t>(n) * 3);
  pt->ref_text.reserve(static_cast<size_t>(n) * 3);
  {
    size_t pos = 0;
    for (int32_t i = 0; i < n; ++i) {
      pt->in_start[i] = static_cast<int32_t>(pt->in_refs.size());
      size_t end = ins.find('\x02', pos);
      if (end == std::string_view::npos) end = ins.size();
      std::string_view node_ins = ins.substr(pos, end - pos);
      pos = end + 1;
      size_t q = 0;
      while (q < node_ins.size()) {
        size_t e = node_ins.find('\x01', q);
        if (e == std::string_view::npos) e = node_ins.size();
        std::string_view ref = node_ins.substr(q, e - q);
        q = e + 1;
        Ref rf{-1, 0, false};
        std::string_view name = ref;
        if (!ref.empty() && ref[0] == '^') {
          rf.ctrl = true;
          rf.port = -1;
          name = ref.substr(1);
        } else {
          const size_t colon = ref.rfind(':');
          int32_t port = 0;
          if (colon != std::string_view::npos && ParsePort(ref.substr(colon + 1), &port)) {
            name = ref.substr(0, colon);
            rf.port = port;
          } else if (colon != std::string_view::npos && colon + 1 < ref.size()) {
            // digits beyond what fits, or non-digits: Python keeps the whole
            // reference as a name when the suffix is not digits; a huge port
            // is no tensor of the graph's nodes either way
            bool digits = true;
            for (char ch : ref.substr(colon + 1)) digits = digits && ch >= '0' && ch <= '9';
            if (digits) {
              delete pt;
              return nullptr;
            }
          }
        }
        rf.src = index.Find(name);
        pt->in_refs.push_back(rf);
        pt->ref_text.push_back(ref);
      }
    }
    pt->in_start[n] = static_cast<int32_t>(pt->in_refs.size());
  }
  // data readers per source node (graph order, then input order)
  std::vector<int32_t> count(n + 1, 0);
  for (int32_t i = 0; i < n; ++i) {
    for (const Ref& rf : pt->In(i)) {
      if (!rf.ctrl && rf.src >= 0) ++count[rf.src];
    }
  }
  pt->cons_start.assign(n + 1, 0);
  for (int32_t i = 0; i < n; ++i) pt->cons_start[i + 1] = pt->cons_start[i] + count[i];
  const int32_t m = pt->cons_start[n];
  pt->cons_node.resize(m);
  pt->cons_idx.resize(m);
  pt->cons_port.resize(m);
  std::vector<int32_t> fill(pt->cons_start.begin(), pt->cons_start.end() - 1);
  for (int32_t i = 0; i < n; ++i) {
    const RefSpan v = pt->In(i);
    for (size_t j = 0; j < v.size(); ++j) {
      if (v[j].ctrl || v[j].src < 0) continue;
      const int32_t e = fill[v[j].src]++;
      pt->cons_node[e] = i;
      pt->cons_idx[e] = static_cast<int32_t>(j);
      pt->cons_port[e] = v[j].port;
    }
  }
  pt->unsafe.assign(n, 0);
  pt->unsafe_known.assign(n, 0);
  return pt;
}

}  // namespace

#define NPU_AMP_PAINT_EXPORT extern "C" __attribute__((visibility("default")))

NPU_AMP_PAINT_EXPORT void* NpuAmpPaintOpen(const char* strings, size_t len, const int32_t* ints,
                                          int64_t n_ints) {
  if (strings == nullptr || ints == nullptr) return nullptr;
  return Open(strings, len, ints, n_ints);
}

// Runs _paint, _demote and _follow_readers.  `answered`: float32 constants
// (indices) whose low-precision safety the caller now knows, `unsafe` those
// of them that cannot hold their values in the low dtype (both remembered
// by the handle).  A constant a loop asks about and nobody answered yet is
// taken as safe and listed in `asked` (at most `cap`).  `out`: n * kOutWidth
// ints (see enum Out).  Returns how many constants were asked unanswered
// (0: the result stands; else answer them and, if one is unsafe, run again),
// -1 on bad arguments.
NPU_AMP_PAINT_EXPORT int64_t NpuAmpPaintRun(void* h, const int32_t* answered, int64_t n_answered,
                                            const int32_t* unsafe, int64_t n_unsafe, int32_t* out,
                                            int64_t n_out, int32_t* asked, int64_t cap) {
  auto* pt = static_cast<Painter*>(h);
  if (pt == nullptr || n_out != static_cast<int64_t>(pt->n) * kOutWidth) return -1;
  for (int64_t j = 0; j < n_answered; ++j) {
    if (answered[j] < 0 || answered[j] >= pt->n) return -1;
    pt->unsafe_known[answered[j]] = 1;
  }
  for (int64_t j = 0; j < n_unsafe; ++j) {
    if (unsafe[j] < 0 || unsafe[j] >= pt->n) return -1;
    pt->unsafe[unsafe[j]] = 1;
    pt->unsafe_known[unsafe[j]] = 1;
  }
  pt->asked.clear();
  pt->asked_seen.assign(pt->n, 0);
  std::vector<int32_t> buf(static_cast<size_t>(n_out), 0);
  for (int32_t i = 0; i < pt->n; ++i) {
    buf[static_cast<size_t>(i) * kOutWidth + kOVoter] = -1;
    buf[static_cast<size_t>(i) * kOutWidth + kORefuseConst] = -1;
  }
  pt->out = &buf;
  pt->cur.resize(pt->n);
  pt->var.assign(pt->n, 0);
  pt->state.assign(pt->n, kStNone);
  pt->lst_out.assign(pt->n, 0);
  for (int32_t i = 0; i < pt->n; ++i) pt->cur[i] = pt->cur0[pt->cls[i]];
  pt->Paint();
  pt->Demote();
  pt->Follow();
  pt->Mismatches();
  pt->ConstWants();
  std::memcpy(out, buf.data(), buf.size() * sizeof(int32_t));
  pt->out = nullptr;
  const int64_t k = static_cast<int64_t>(pt->asked.size());
  for (int64_t j = 0; j < k && j < cap; ++j) asked[j] = pt->asked[j];
  return k;
}

// (issue 17) amp.py _fix_edges_bulk's plan after a run (see CastPlan): `out`
// the result record as Python applied it, `ints` the overrides and the Casts
// with control inputs.  0: `*data`/`*len` hold the plan (valid until the next
// call or NpuAmpPaintClose): int32 counts (new casts, steps, saves), per new
// cast (source node, SrcT, DstT), per step (new cast or -1, node, input),
// per save the node, then the text (new names, their roots, the steps'
// references); 1: a form left to Python; -1: bad arguments.
NPU_AMP_PAINT_EXPORT int NpuAmpPaintFixEdges(void* h, const int32_t* out, int64_t n_out,
                                             const int32_t* ints, int64_t n_ints, const char** data,
                                             size_t* len) {
  auto* pt = static_cast<Painter*>(h);
  if (pt == nullptr || out == nullptr || ints == nullptr || data == nullptr || len == nullptr ||
      n_out != static_cast<int64_t>(pt->n) * kOutWidth) {
    return -1;
  }
  pt->fix_plan.reset();
  auto plan = std::make_shared<CastPlan>(*pt);
  if (!plan->Load(out, ints, n_ints)) return -1;
  if (!plan->Run(&pt->fix_blob)) return 1;
  pt->fix_plan = plan;
  *data = pt->fix_blob.data();
  *len = pt->fix_blob.size();
  return 0;
}

// (issue 17) amp.py _delay_widening_casts' plan after NpuAmpPaintFixEdges
// (see CastPlan::Delay): `pos` n + (new casts) Kahn positions.  0: `*data`/
// `*len` hold int32 [forward, then per copy that waits: its new-cast index,
// the count of its waits, the waits (a painted node, or n + a new cast)];
// -1: bad arguments or no plan made.
NPU_AMP_PAINT_EXPORT int NpuAmpPaintDelayPlan(void* h, const int32_t* pos, int64_t n_pos,
                                              const char** data, size_t* len) {
  auto* pt = static_cast<Painter*>(h);
  if (pt == nullptr || pos == nullptr || data == nullptr || len == nullptr || !pt->fix_plan) return -1;
  const auto* plan = static_cast<const CastPlan*>(pt->fix_plan.get());
  if (n_pos != static_cast<int64_t>(pt->n) + plan->new_count()) return -1;
  std::vector<int32_t> out;
  bool forward = true;
  plan->Delay(pos, &out, &forward);
  const int32_t f = forward ? 1 : 0;
  pt->fix_blob.assign(reinterpret_cast<const char*>(&f), sizeof(f));
  pt->fix_blob.append(reinterpret_cast<const char*>(out.data()), out.size() * sizeof(int32_t));
  *data = pt->fix_blob.data();
  *len = pt->fix_blob.size();
  return 0;
}

NPU_AMP_PAINT_EXPORT void NpuAmpPaintClose(void* h) { delete static_cast<Painter*>(h); }

NPU_AMP_PAINT_EXPORT int NpuAmpPaintVersion() { return kVersion; }
