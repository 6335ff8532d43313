// npu_amp_tf::NameTable: names -> ids in insertion order, for the C++ parts
// that look node names up by the thousand (the bridge's index, the OpDef
// pre-check, the gradient-region mirror, the precision painting).  No
// TensorFlow types: precision_paint.cc uses it without TensorFlow headers.
#ifndef NPU_AMP_TF_NAME_TABLE_H_
#define NPU_AMP_TF_NAME_TABLE_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <vector>

namespace npu_amp_tf {

// (issue 17u) An open-addressing table of names (views: the caller keeps the
// bytes alive) -> ids 0, 1, 2... in insertion order: what the bridge's index
// and the pre-check look names up in (a std::unordered_map chases a node and
// its key per lookup; ~63k lookups per Keras ResNet-50 training graph).
class NameTable {
 public:
  void Reserve(size_t n) {
    size_t cap = 16;
    while (cap < n * 2) cap <<= 1;
    slots_.assign(cap, Slot{0, -1});
    mask_ = cap - 1;
    keys_.clear();
    keys_.reserve(n);
  }
  size_t size() const { return keys_.size(); }
  std::string_view key(int32_t id) const { return keys_[id]; }
  // Adds `name` with the id size(); false (nothing added) when it is present.
  bool Insert(std::string_view name) {
    if ((keys_.size() + 1) * 2 > slots_.size()) Grow();
    const uint64_t h = Hash(name);
    const uint32_t tag = static_cast<uint32_t>(h >> 32);
    for (size_t i = h & mask_;; i = (i + 1) & mask_) {
      Slot& s = slots_[i];
      if (s.id < 0) {
        s.tag = tag;
        s.id = static_cast<int32_t>(keys_.size());
        keys_.push_back(name);
        return true;
      }
      if (s.tag == tag && keys_[s.id] == name) return false;
    }
  }
  // (issue 17) The id of `name`; or -1, and *at / *tag where InsertAt puts
  // it: one hash for a name looked up and then added (valid until the next
  // insert; the table has grown first if that insert needs it).
  int32_t FindSlot(std::string_view name, size_t* at, uint32_t* tag) {
    if ((keys_.size() + 1) * 2 > slots_.size()) Grow();
    const uint64_t h = Hash(name);
    *tag = static_cast<uint32_t>(h >> 32);
    for (size_t i = h & mask_;; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.id < 0) {
        *at = i;
        return -1;
      }
      if (s.tag == *tag && keys_[s.id] == name) return s.id;
    }
  }
  // Adds `name` (equal to the name FindSlot was given) with the id size().
  void InsertAt(size_t at, uint32_t tag, std::string_view name) {
    slots_[at] = Slot{tag, static_cast<int32_t>(keys_.size())};
    keys_.push_back(name);
  }
  // The id of `name`, or -1.
  int32_t Find(std::string_view name) const {
    if (slots_.empty()) return -1;
    const uint64_t h = Hash(name);
    const uint32_t tag = static_cast<uint32_t>(h >> 32);
    for (size_t i = h & mask_;; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.id < 0) return -1;
      if (s.tag == tag && keys_[s.id] == name) return s.id;
    }
  }
  static uint64_t Hash(std::string_view s) {
    uint64_t h = 0x9e3779b97f4a7c15ULL ^ s.size();
    const char* p = s.data();
    size_t n = s.size();
    for (; n >= 8; n -= 8, p += 8) {
      uint64_t w;
      std::memcpy(&w, p, 8);
      h = (h ^ w) * 0xff51afd7ed558ccdULL;
      h ^= h >> 32;
    }
    uint64_t w = 0;
    std::memcpy(&w, p, n);
    h = (h ^ w) * 0xc4ceb9fe1a85ec53ULL;
    return h ^ (h >> 29);
  }

 private:
  struct Slot {
    uint32_t tag;
    int32_t id;
  };
  void Grow() {
    std::vector<std::string_view> keys;
    keys.swap(keys_);
    Reserve(keys.size() * 2 + 8);
    for (auto k : keys) Insert(k);
  }
  std::vector<Slot> slots_;
  size_t mask_ = 0;
  std::vector<std::string_view> keys_;
};

}  // namespace npu_amp_tf

#endif  // NPU_AMP_TF_NAME_TABLE_H_
