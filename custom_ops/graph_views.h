// The names, ops and inputs of a serialized GraphDef read as views of its
// bytes, without parsing it (issue 17): the grappler bridge's index
// (grappler_bridge.cc, NpuAmpItemIndex) and the gradient-region search's
// mirror (grad_region.cc) read them this way.  No TensorFlow types.
#ifndef NPU_AMP_TF_GRAPH_VIEWS_H_
#define NPU_AMP_TF_GRAPH_VIEWS_H_

#include <algorithm>
#include <cstdint>
#include <string_view>
#include <vector>

namespace npu_amp_tf {

// A graph's names, ops and inputs as views (of a GraphDef, or of its bytes).
struct GraphViews {
  std::vector<std::string_view> name, op, input;
  std::vector<int64_t> in_start{0};  // node i's inputs: input[in_start[i] .. in_start[i+1])
  // (set `want_defs` first) node i's NodeDef bytes: grad_region.cc's shape
  // walk reads their attrs
  bool want_defs = false;
  std::vector<std::string_view> def;
  // (issue 17, set `want_attrs` first; ViewsOfBytes only) whether a node has
  // a device string (NodeDef.device = 4), and the distinct names beginning
  // with '_' of the nodes' attrs (NodeDef.attr = 5, each entry's key: the
  // user's _keep_dtype marks, _class, ...), kept while there are at most
  // kMaxPrivateAttrs of them.  `device_known` / `attrs_known`: they were
  // read (false: not asked, or read from a parsed GraphDef; the names also
  // when there were more than that)
  bool want_attrs = false;
  bool device_known = false;
  bool attrs_known = false;
  bool any_device = false;
  std::vector<std::string_view> private_attrs;
  static constexpr size_t kMaxPrivateAttrs = 32;
};

// Protobuf wire format: a varint at *p (< end); false on a bad one.
inline bool ReadVarint(const char*& p, const char* end, uint64_t* out) {
  uint64_t x = 0;
  for (int shift = 0; shift < 64 && p < end; shift += 7) {
    const uint8_t b = static_cast<uint8_t>(*p++);
    x |= static_cast<uint64_t>(b & 0x7f) << shift;
    if (!(b & 0x80)) {
      *out = x;
      return true;
    }
  }
  return false;
}

// Skips a field of wire type `wt` at p; false on a bad or group field.
inline bool SkipField(const char*& p, const char* end, uint64_t wt) {
  uint64_t len;
  switch (wt) {
    case 0: return ReadVarint(p, end, &len);
    case 1: if (end - p < 8) return false; p += 8; return true;
    case 5: if (end - p < 4) return false; p += 4; return true;
    case 2:
      if (!ReadVarint(p, end, &len) || len > static_cast<uint64_t>(end - p)) return false;
      p += len;
      return true;
    default: return false;
  }
}

// Calls node(begin, end) with the bytes of each NodeDef of the GraphDef
// serialized in `bytes` (GraphDef.node = 1), in order; every other field
// skipped.  False when the bytes are not a plain wire-format GraphDef, or when
// node() returns false.
template <typename F>
inline bool ForEachNodeOfBytes(std::string_view bytes, F&& node) {
  const char* p = bytes.data();
  const char* end = p + bytes.size();
  while (p < end) {
    uint64_t tag, len;
    if (!ReadVarint(p, end, &tag)) return false;
    if (tag != ((1 << 3) | 2)) {
      if ((tag >> 3) == 1 || !SkipField(p, end, tag & 7)) return false;
      continue;
    }
    if (!ReadVarint(p, end, &len) || len > static_cast<uint64_t>(end - p)) return false;
    const char* q = p;
    p += len;
    if (!node(q, p)) return false;
  }
  return true;
}

// Calls str(field, value) for each field numbered 1..`last` of the message in
// [q, end) (each must be length-delimited: a string), in order; the other
// fields skipped.  False on bad wire format.
template <typename F>
inline bool StringFields(const char* q, const char* end, uint64_t last, F&& str) {
  while (q < end) {
    uint64_t tag, len;
    if (!ReadVarint(q, end, &tag)) return false;
    const uint64_t field = tag >> 3;
    if (field >= 1 && field <= last) {
      if ((tag & 7) != 2) return false;
      if (!ReadVarint(q, end, &len) || len > static_cast<uint64_t>(end - q)) return false;
      str(field, std::string_view(q, len));
      q += len;
    } else if (!SkipField(q, end, tag & 7)) {
      return false;
    }
  }
  return true;
}

// The views of the GraphDef serialized in `bytes` (GraphDef.node = 1;
// NodeDef.name = 1, op = 2, input = 3; every other field skipped), with the
// parser's rules: a singular field given twice keeps the last, repeated
// inputs append.  False when the bytes are not a plain wire-format GraphDef
// (the caller then reads the parsed graph).
// The key of the map entry serialized in [q, end) (its field 1; the last
// one when given twice, as the parser keeps it; empty when none); false on
// bad wire format.
inline bool MapEntryKey(const char* q, const char* end, std::string_view* key) {
  *key = std::string_view();
  while (q < end) {
    uint64_t tag, len;
    if (!ReadVarint(q, end, &tag)) return false;
    if (tag == ((1 << 3) | 2)) {
      if (!ReadVarint(q, end, &len) || len > static_cast<uint64_t>(end - q)) return false;
      *key = std::string_view(q, len);
      q += len;
    } else if (!SkipField(q, end, tag & 7)) {
      return false;
    }
  }
  return true;
}

// (want_attrs) NodeDef field 4 (device) or 5 (an attr map entry) `str` noted
// in *v; `attrs_ok` false from the first entry that cannot be read, or past
// kMaxPrivateAttrs names.
inline void NoteDeviceOrAttr(uint64_t field, std::string_view str, GraphViews* v, bool* attrs_ok) {
  if (field == 4) {
    v->any_device = v->any_device || !str.empty();
    return;
  }
  if (!*attrs_ok) return;
  std::string_view key;
  if (!MapEntryKey(str.data(), str.data() + str.size(), &key)) {
    *attrs_ok = false;  // (the parser refuses it too; the reference answers)
    return;
  }
  if (key.empty() || key[0] != '_') return;
  auto& seen = v->private_attrs;
  if (std::find(seen.begin(), seen.end(), key) != seen.end()) return;
  if (seen.size() >= GraphViews::kMaxPrivateAttrs) {
    *attrs_ok = false;
    return;
  }
  seen.push_back(key);
}

// (issue 17) Only the device strings and attrs of the GraphDef serialized in
// `bytes` noted in *v (NoteDeviceOrAttr), for views read without them; false
// as ViewsOfBytes (the same field rules: StringFields over fields 1-5).
inline bool AttrsOfBytes(std::string_view bytes, GraphViews* v) {
  bool attrs_ok = true;
  const bool ok_all = ForEachNodeOfBytes(bytes, [v, &attrs_ok](const char* q, const char* node_end) {
    return StringFields(q, node_end, 5, [&](uint64_t field, std::string_view str) {
      if (field >= 4) NoteDeviceOrAttr(field, str, v, &attrs_ok);
    });
  });
  v->device_known = ok_all;
  v->attrs_known = ok_all && attrs_ok;
  return ok_all;
}

inline bool ViewsOfBytes(std::string_view bytes, GraphViews* v) {
  bool attrs_ok = v->want_attrs;
  const bool ok_all = ForEachNodeOfBytes(bytes, [v, &attrs_ok](const char* q, const char* node_end) {
    std::string_view name, op;
    // (want_attrs) fields 4 and 5 read too; fields 1-3 as StringFields reads them
    const bool ok = StringFields(q, node_end, v->want_attrs ? 5 : 3, [&](uint64_t field, std::string_view str) {
      if (field == 1) {
        name = str;
      } else if (field == 2) {
        op = str;
      } else if (field == 3) {
        v->input.push_back(str);
      } else {
        NoteDeviceOrAttr(field, str, v, &attrs_ok);
      }
    });
    if (!ok) return false;
    v->name.push_back(name);
    v->op.push_back(op);
    if (v->want_defs) v->def.emplace_back(q, static_cast<size_t>(node_end - q));
    v->in_start.push_back(static_cast<int64_t>(v->input.size()));
    return true;
  });
  v->device_known = ok_all && v->want_attrs;
  v->attrs_known = ok_all && attrs_ok;
  return ok_all;
}

// Only the node names of the GraphDef serialized in `bytes` (ViewsOfBytes'
// rules), appended to *names: one sequential read of the bytes, where the
// parsed NodeDefs' name strings lie scattered on the heap.  False as
// ViewsOfBytes.
inline bool NamesOfBytes(std::string_view bytes, std::vector<std::string_view>* names) {
  return ForEachNodeOfBytes(bytes, [names](const char* q, const char* node_end) {
    std::string_view name;
    if (!StringFields(q, node_end, 1, [&](uint64_t, std::string_view str) { name = str; })) return false;
    names->push_back(name);
    return true;
  });
}

}  // namespace npu_amp_tf

#endif  // NPU_AMP_TF_GRAPH_VIEWS_H_
