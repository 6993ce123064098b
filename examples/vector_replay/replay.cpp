// replay.cpp: replay a kvcache golden vector against a tiny C++ backend.
//
// The backend is the bookkeeping of a paged slot cache (spec/slot-cache.md):
// block pool with the null block 0, free list, prefix index with token
// verification, block table, admit / retire / prepare_step / reserve /
// update_position / evict_batch / reset, and K/V storage written through
// StepIndices.slot_mapping (float16 kept as raw bits). It reads a vector
// (spec/vectors.md), performs every record, and checks the result or the
// error, then the state (seq_lens, block_table, free_order, kv_sha256).
//
//   g++ -std=c++17 -O1 -o replay replay.cpp
//   ./replay spec/vectors/slot_cache_paged.json [spec/vectors/hashing.json]
//
// Exit status 0 when every record matches, 1 at the first difference.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iostream>
#include <list>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "json.hpp"
#include "sha256.hpp"

using mini_json::Value;
using I64 = std::vector<int64_t>;

// ------------------------------------------------------------------ errors

struct KVError {
    std::string type, message;
};
[[noreturn]] static void raise(const std::string& type, const std::string& message) { throw KVError{type, message}; }
static std::string str(int64_t x) { return std::to_string(x); }

// ------------------------------------------------------------------ float16 (exact for the vectors' values)

static uint16_t to_half(double x) {
    if (x == 0) return std::signbit(x) ? 0x8000 : 0;
    uint16_t sign = x < 0 ? 0x8000 : 0;
    double a = std::fabs(x);
    int e;
    double m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
    int exp = e - 1 + 15;          // biased exponent of 1.f form
    if (exp <= 0) {                // subnormal: a = f * 2^-24
        return sign | uint16_t(std::lround(a / std::ldexp(1.0, -24)));
    }
    uint16_t frac = uint16_t(std::lround((m * 2 - 1) * 1024));
    return sign | uint16_t(exp << 10) | frac;
}

// ------------------------------------------------------------------ the hash chain (spec/hashing.md)

static std::string sha(const std::string& bytes) {
    mini_sha256::Sha256 h;
    h.update(bytes.data(), bytes.size());
    auto d = h.digest();
    return std::string(d.begin(), d.end());
}
static std::string root_hash(uint64_t seed, const std::string& salt) {
    std::string b = "kvcache/v1";
    for (int i = 0; i < 8; ++i) b += char((seed >> (8 * i)) & 0xFF);
    return sha(b + salt);
}
static std::string block_hash(const std::string& parent, const int32_t* tokens, int n) {
    std::string b = parent;
    for (int i = 0; i < n; ++i)
        for (int j = 0; j < 4; ++j) b += char((uint32_t(tokens[i]) >> (8 * j)) & 0xFF);
    return sha(b);
}
static std::string hexs(const std::string& raw) { return mini_sha256::hex(std::vector<uint8_t>(raw.begin(), raw.end())); }

// ------------------------------------------------------------------ block pool

struct Pool {
    int n = 0;
    std::vector<int> ref;
    std::vector<std::string> hash;  // "" = unpublished
    std::vector<std::vector<int32_t>> toks;
    std::map<std::string, int> index;
    std::list<int> free;  // front = next to hand out

    void reset(int num_blocks) {
        n = num_blocks;
        ref.assign(n, 0);
        hash.assign(n, "");
        toks.assign(n, {});
        index.clear();
        free.clear();
        for (int b = 1; b < n; ++b) free.push_back(b);
    }
    void unpublish(int b) {
        if (!hash[b].empty()) index.erase(hash[b]);
        hash[b].clear();
        toks[b].clear();
    }
    std::vector<int> allocate(int k) {
        std::vector<int> out;
        for (int i = 0; i < k; ++i) {
            int b = free.front();
            free.pop_front();
            unpublish(b);  // evicting a published block
            ref[b] = 1;
            out.push_back(b);
        }
        return out;
    }
    void touch(int b) {
        if (ref[b] == 0) free.remove(b);
        ++ref[b];
    }
    void release(int b) {  // a block reaching 0: back of the list if published, front if not
        if (b == 0) return;
        if (--ref[b] == 0) {
            if (hash[b].empty()) free.push_front(b);
            else free.push_back(b);
        }
    }
    int lookup(const std::string& h, const int32_t* t, int P) const {
        auto it = index.find(h);
        if (it == index.end()) return -1;
        const auto& s = toks[it->second];
        return std::equal(s.begin(), s.end(), t, t + P) && int(s.size()) == P ? it->second : -1;
    }
    void publish(int b, const std::string& h, const int32_t* t, int P) {
        if (!hash[b].empty()) return;
        if (index.count(h)) return;  // a twin (or a collision) keeps the existing copy
        hash[b] = h;
        toks[b].assign(t, t + P);
        index[h] = b;
    }
};

// ------------------------------------------------------------------ the paged slot cache

struct Arr {  // an encoded array of a result
    std::string dtype;
    I64 shape, data;
};

struct Step {
    int64_t num_tokens = 0;
    I64 slot_mapping;
};

struct Cache {
    int S, L, P, M, NB;
    uint64_t seed;
    bool prefix;
    std::vector<std::pair<int, int>> layers;  // (kv_heads, head_dim)
    I64 seq, nblk, nshared;
    std::vector<I64> table;
    std::vector<std::vector<uint16_t>> K, V;
    Pool pool;
    Step last;
    bool have_step = false;

    explicit Cache(const Value& cfg, const Value& lays) {
        if (cfg["mode"].as_string() != "PAGED") raise("RuntimeError", "this example replays paged caches only");
        if (cfg["dtype"].as_string() != "float16") raise("ValueError", "this example stores float16 only");
        if (cfg["hash_algo"].as_string() != "sha256") raise("ValueError", "this example hashes with sha256 only");
        S = int(cfg["max_seqs"].as_int());
        L = int(cfg["max_seq_len"].as_int());
        P = int(cfg["block_size"].as_int());
        M = (L + P - 1) / P;
        NB = int(cfg["num_blocks"].as_int());
        if (NB == 0) NB = S * M + 1;
        seed = cfg["hash_seed"].as_u64();
        prefix = cfg["enable_prefix_caching"].b;
        for (const Value& l : lays.items) {
            if (l["kind"].as_string() != "ATTENTION") raise("ValueError", "this example has attention layers only");
            layers.push_back({int(l["kv_heads"].as_int()), int(l["head_dim"].as_int())});
        }
        K.resize(layers.size());
        V.resize(layers.size());
        reset();
    }

    void reset() {
        seq.assign(S, 0);
        nblk.assign(S, 0);
        nshared.assign(S, 0);
        table.assign(S, I64(M, 0));
        for (size_t l = 0; l < layers.size(); ++l) {
            size_t n = size_t(NB) * P * layers[l].first * layers[l].second;
            K[l].assign(n, 0);
            V[l].assign(n, 0);
        }
        pool.reset(NB);
        have_step = false;
    }

    int64_t capacity(int s) const { return std::min<int64_t>(nblk[s] * P, L); }

    int index(const std::string& api, const std::string& name, int64_t v) const {
        if (v < 0 || v >= S) raise("IndexError", api + ": " + name + "=" + str(v) + " out of range [0, " + str(S) + ")");
        return int(v);
    }

    void check_slots(const std::string& api, const I64& slots) const {
        for (size_t i = 0; i < slots.size(); ++i) {
            if (slots[i] < 0 || slots[i] >= S)
                raise("IndexError", api + ": slot_ids[" + str(i) + "]=" + str(slots[i]) + " out of range [0, " + str(S) + ")");
            for (size_t j = 0; j < i; ++j)
                if (slots[j] == slots[i])
                    raise("ValueError", api + ": slot_ids[" + str(i) + "]=" + str(slots[i]) + " duplicates slot_ids[" + str(j) + "]");
        }
    }

    // All or nothing: add[i] fresh blocks to row slots[i], one pop from the front for the whole call.
    void grow(const std::string& api, const I64& slots, const I64& new_len) {
        I64 add(slots.size());
        int64_t total = 0;
        for (size_t i = 0; i < slots.size(); ++i) {
            add[i] = std::max<int64_t>((new_len[i] + P - 1) / P - nblk[slots[i]], 0);
            total += add[i];
        }
        if (total > int64_t(pool.free.size()))
            raise("CapacityError", api + ": needs " + str(total) + " blocks, " + str(pool.free.size()) + " free or evictable");
        std::vector<int> blocks = pool.allocate(int(total));
        size_t k = 0;
        for (size_t i = 0; i < slots.size(); ++i)
            for (int64_t j = 0; j < add[i]; ++j) table[slots[i]][nblk[slots[i]]++] = blocks[k++];
    }

    std::map<std::string, Arr> prepare_step(const I64& cu, const I64& past, const I64& slots) {
        const std::string api = "prepare_step";
        size_t B = slots.size();
        if (cu.size() != B + 1)
            raise("ValueError", api + ": len(cu_seqlens_q)=" + str(cu.size()) + " != len(slot_ids)+1=" + str(B + 1));
        if (past.size() != B) raise("ValueError", api + ": len(past_len)=" + str(past.size()) + " != len(slot_ids)=" + str(B));
        if (cu[0] != 0) raise("ValueError", api + ": cu_seqlens_q[0]=" + str(cu[0]) + ", must be 0");
        for (size_t i = 1; i < cu.size(); ++i)
            if (cu[i] <= cu[i - 1])
                raise("ValueError", api + ": cu_seqlens_q[" + str(i) + "]=" + str(cu[i]) + " <= cu_seqlens_q[" + str(i - 1) +
                                        "]=" + str(cu[i - 1]) + ", must be strictly increasing");
        check_slots(api, slots);
        for (size_t i = 0; i < B; ++i)
            if (past[i] != seq[slots[i]])
                raise("ValueError", api + ": past_len[" + str(i) + "]=" + str(past[i]) + " but seq_lens()[slot " +
                                        str(slots[i]) + "]=" + str(seq[slots[i]]));
        I64 need(B);
        for (size_t i = 0; i < B; ++i) {
            int64_t q = cu[i + 1] - cu[i];
            if (q > L - past[i])
                raise("CapacityError", api + ": past_len[" + str(i) + "]+q_len[" + str(i) + "]=" + str(past[i]) + "+" + str(q) +
                                           "=" + str(past[i] + q) + " > max_seq_len=" + str(L));
            need[i] = past[i] + q;
        }
        grow(api, slots, need);
        // StepIndices (spec/slot-cache.md §3): token t of row b sits at position past[b] + (t - cu[b]).
        std::map<std::string, Arr> r;
        int64_t T = cu[B];
        Arr batch{"int32", {T}, {}}, pos{"int32", {T}, {}}, sm{"int64", {T}, {}};
        Arr used{"int32", {int64_t(B)}, {}}, cuk{"int32", {int64_t(B) + 1}, {0}}, bt{"int32", {int64_t(B), M}, {}};
        Arr init{"bool", {int64_t(B)}, {}}, cross{"int32", {int64_t(B)}, {}}, logits{"int32", {int64_t(B)}, {}};
        int64_t maxq = 0, maxk = 0;
        for (size_t b = 0; b < B; ++b) {
            int64_t q = cu[b + 1] - cu[b], k = past[b] + q;
            maxq = std::max(maxq, q);
            maxk = std::max(maxk, k);
            used.data.push_back(k);
            cuk.data.push_back(cuk.data.back() + k);
            init.data.push_back(past[b] > 0);
            cross.data.push_back(0);
            logits.data.push_back(cu[b + 1] - 1);
            for (int c = 0; c < M; ++c) bt.data.push_back(table[slots[b]][c]);
            for (int64_t t = 0; t < q; ++t) {
                int64_t p = past[b] + t;
                batch.data.push_back(int64_t(b));
                pos.data.push_back(p);
                sm.data.push_back(table[slots[b]][p / P] * P + p % P);
            }
        }
        r["batch_indices"] = batch;
        r["block_table"] = bt;
        r["cross_seqused_k"] = cross;
        r["cu_seqlens_k"] = cuk;
        r["cu_seqlens_q"] = Arr{"int32", {int64_t(B) + 1}, cu};
        r["has_initial_state"] = init;
        r["logits_indices"] = logits;
        r["max_seqlen_k"] = Arr{"scalar", {}, {maxk}};
        r["max_seqlen_q"] = Arr{"scalar", {}, {maxq}};
        r["past_len"] = Arr{"int32", {int64_t(B)}, past};
        r["positions"] = pos;
        r["seqused_k"] = used;
        r["slot_ids"] = Arr{"int32", {int64_t(B)}, slots};
        r["slot_mapping"] = sm;
        last = Step{T, sm.data};
        have_step = true;
        return r;
    }

    void append_kv(int layer, const Value& k, const Value& v) {
        const std::string api = "append_kv";
        if (!have_step) raise("ValueError", api + ": no step prepared");
        auto [H, D] = layers.at(layer);
        for (const Value* x : {&k, &v}) {
            const char* name = x == &k ? "k" : "v";
            int64_t t = (*x)["shape"][0].as_int();
            if (t != last.num_tokens)
                raise("ValueError", api + ": " + name + ".shape[0]=" + str(t) + " != step.num_tokens=" + str(last.num_tokens));
        }
        size_t row = size_t(H) * D;
        for (int64_t t = 0; t < last.num_tokens; ++t) {
            size_t at = size_t(last.slot_mapping[t]) * row;
            for (size_t j = 0; j < row; ++j) {
                K[layer][at + j] = to_half(k["data"][t * row + j].as_double());
                V[layer][at + j] = to_half(v["data"][t * row + j].as_double());
            }
        }
    }

    void update_position(int64_t b_, int64_t pos) {
        const std::string api = "update_position";
        int b = index(api, "batch_idx", b_);
        if (pos < 0) raise("ValueError", api + ": new_pos=" + str(pos) + " < 0");
        if (pos > capacity(b)) raise("ValueError", api + ": new_pos=" + str(pos) + " > capacity=" + str(capacity(b)) + " of slot " + str(b));
        if (pos < nshared[b] * P)
            raise("ValueError", api + ": new_pos=" + str(pos) + " < shared prefix=" + str(nshared[b] * P) + " of slot " + str(b));
        seq[b] = pos;
    }

    Arr reserve(const I64& slots, const I64& n) {
        const std::string api = "reserve";
        if (n.size() != slots.size())
            raise("ValueError", api + ": len(n_new_per_seq)=" + str(n.size()) + " != len(slot_ids)=" + str(slots.size()));
        check_slots(api, slots);
        for (size_t i = 0; i < n.size(); ++i)
            if (n[i] < 0) raise("ValueError", api + ": n_new_per_seq[" + str(i) + "]=" + str(n[i]) + " < 0");
        I64 before, after;
        for (size_t i = 0; i < slots.size(); ++i) {
            int64_t b = seq[slots[i]];
            if (n[i] > L - b)
                raise("CapacityError", api + ": seq_lens()[slot " + str(slots[i]) + "]+n_new_per_seq[" + str(i) + "]=" + str(b) +
                                           "+" + str(n[i]) + "=" + str(b + n[i]) + " > max_seq_len=" + str(L));
            before.push_back(b);
            after.push_back(b + n[i]);
        }
        grow(api, slots, after);
        for (size_t i = 0; i < slots.size(); ++i)
            if (n[i]) seq[slots[i]] = after[i];
        return Arr{"int32", {int64_t(slots.size())}, before};
    }

    std::vector<std::string> chain(const std::vector<int32_t>& t, int64_t nblocks) const {
        std::vector<std::string> out;
        std::string parent = root_hash(seed, "");  // the slot cache's chain has no salt
        for (int64_t i = 0; i < nblocks; ++i) out.push_back(parent = block_hash(parent, &t[i * P], P));
        return out;
    }

    int64_t admit(int64_t b_, const std::vector<int32_t>& t, int64_t addr) {
        const std::string api = "admit";
        int b = index(api, "batch_idx", b_);
        if (t.empty()) raise("ValueError", api + ": len(prompt_ids)=0, must be >= 1");
        if (addr < -1) raise("ValueError", api + ": addressable_len=" + str(addr) + " < -1 (-1 means len(prompt_ids)-1)");
        if (seq[b] != 0 || nblk[b] != 0)
            raise("ValueError", api + ": batch_idx=" + str(b) + " holds seq_len=" + str(seq[b]) + " and " + str(nblk[b]) +
                                    " blocks, must be empty");
        int64_t limit = addr == -1 ? int64_t(t.size()) - 1 : std::min<int64_t>(addr, t.size());
        std::vector<int> hits;
        if (prefix) {
            auto hs = chain(t, limit / P);
            for (size_t i = 0; i < hs.size(); ++i) {
                int blk = pool.lookup(hs[i], &t[i * P], P);
                if (blk < 0) break;
                hits.push_back(blk);
            }
        }
        for (size_t c = 0; c < hits.size(); ++c) {
            pool.touch(hits[c]);
            table[b][c] = hits[c];
        }
        nblk[b] = nshared[b] = int64_t(hits.size());
        seq[b] = int64_t(hits.size()) * P;
        return seq[b];
    }

    void release(int b) {  // tail first, so a chain's tail is evicted before its head
        for (int64_t c = nblk[b] - 1; c >= 0; --c) pool.release(int(table[b][c]));
        std::fill(table[b].begin(), table[b].end(), 0);
        nblk[b] = nshared[b] = seq[b] = 0;
    }

    void retire(int64_t b_, const std::vector<int32_t>& t, int64_t addr) {
        const std::string api = "retire";
        int b = index(api, "batch_idx", b_);
        int64_t s = seq[b], n = int64_t(t.size());
        if (addr < -1)
            raise("ValueError", api + ": addressable_len=" + str(addr) + " < -1 (-1 means min(len(full_token_ids), seq_len))");
        if (addr > s) raise("ValueError", api + ": addressable_len=" + str(addr) + " > seq_lens()[" + str(b) + "]=" + str(s));
        if (addr > n) raise("ValueError", api + ": addressable_len=" + str(addr) + " > len(full_token_ids)=" + str(n));
        int64_t a = addr == -1 ? std::min(n, s) : addr;
        int64_t npub = prefix ? a / P : 0;
        for (int64_t c = 0; c < std::min(nshared[b], npub); ++c) {
            const auto& stored = pool.toks[table[b][c]];
            for (int j = 0; j < P; ++j)
                if (stored[j] != t[c * P + j])
                    raise("ValueError", api + ": full_token_ids[" + str(c * P + j) + "]=" + str(t[c * P + j]) +
                                            " but adopted block " + str(c) + " holds " + str(stored[j]));
        }
        auto hs = chain(t, npub);
        for (int64_t c = 0; c < npub; ++c) pool.publish(int(table[b][c]), hs[c], &t[c * P], P);
        release(b);
    }

    void evict_batch(int64_t b) { release(index("evict_batch", "batch_idx", b)); }

    // state: seq_lens, block_table, free_order, kv_sha256 (per layer, per slot: live K then V bytes)
    std::string kv_sha256() const {
        mini_sha256::Sha256 h;
        for (size_t l = 0; l < layers.size(); ++l) {
            size_t row = size_t(layers[l].first) * layers[l].second;
            for (int s = 0; s < S; ++s)
                for (const auto* store : {&K[l], &V[l]})
                    for (int64_t p = 0; p < seq[s]; ++p) {
                        size_t at = size_t(table[s][p / P] * P + p % P) * row;
                        h.update(&(*store)[at], row * sizeof(uint16_t));  // little-endian hosts
                    }
        }
        return mini_sha256::hex(h.digest());
    }
};

// ------------------------------------------------------------------ comparison

static int failures = 0;
static void differ(size_t i, const std::string& op, const std::string& what, const std::string& got, const std::string& want) {
    std::cout << "record " << i << " (" << op << "): " << what << ": got " << got << ", vector has " << want << "\n";
    ++failures;
}
static std::string join(const I64& v) {
    std::ostringstream o;
    o << "[";
    for (size_t i = 0; i < v.size(); ++i) o << (i ? ", " : "") << v[i];
    return o.str() + "]";
}
static I64 ints(const Value& v) {
    I64 out;
    for (const Value& x : v.items) out.push_back(x.kind == Value::Bool ? int64_t(x.b) : x.as_int());
    return out;
}
static void compare_arr(size_t i, const std::string& op, const std::string& what, const Arr& got, const Value& want) {
    if (got.dtype == "scalar") {
        if (got.data[0] != want.as_int()) differ(i, op, what, str(got.data[0]), want.text);
        return;
    }
    if (want["dtype"].as_string() != got.dtype) differ(i, op, what + ".dtype", got.dtype, want["dtype"].as_string());
    if (ints(want["shape"]) != got.shape) differ(i, op, what + ".shape", join(got.shape), join(ints(want["shape"])));
    if (ints(want["data"]) != got.data) differ(i, op, what, join(got.data), join(ints(want["data"])));
}
static std::vector<int32_t> tokens(const Value& v) {
    std::vector<int32_t> t;
    for (const Value& x : v.items) t.push_back(int32_t(x.as_int()));
    return t;
}

static int replay_cache(const Value& vec) {
    Cache cache(vec["config"], vec["layers"]);
    const Value& records = vec["records"];
    for (size_t i = 0; i < records.size(); ++i) {
        const Value& r = records[i];
        const std::string op = r["op"].as_string();
        const Value& a = r["args"];
        try {
            if (op == "prepare_step") {
                auto got = cache.prepare_step(ints(a["cu_seqlens_q"]), ints(a["past_len"]), ints(a["slot_ids"]));
                if (!r.has("error"))
                    for (const auto& [field, want] : r["result"].fields) {
                        if (!got.count(field)) differ(i, op, field, "(missing)", "a value");
                        else compare_arr(i, op, "result." + field, got[field], want);
                    }
            } else if (op == "append_kv") {
                cache.append_kv(int(a["layer"].as_int()), a["k"], a["v"]);
            } else if (op == "update_position") {
                cache.update_position(a["batch_idx"].as_int(), a["new_pos"].as_int());
            } else if (op == "reserve") {
                Arr got = cache.reserve(ints(a["slot_ids"]), ints(a["n_new_per_seq"]));
                if (!r.has("error")) compare_arr(i, op, "result", got, r["result"]);
            } else if (op == "admit") {
                int64_t hit = cache.admit(a["batch_idx"].as_int(), tokens(a["prompt_ids"]), a["addressable_len"].as_int());
                if (!r.has("error") && hit != r["result"].as_int()) differ(i, op, "result", str(hit), r["result"].text);
            } else if (op == "retire") {
                cache.retire(a["batch_idx"].as_int(), tokens(a["full_token_ids"]), a["addressable_len"].as_int());
            } else if (op == "evict_batch") {
                cache.evict_batch(a["batch_idx"].as_int());
            } else if (op == "reset") {
                cache.reset();
            } else {
                std::cout << "record " << i << ": op " << op << " is not implemented by this example\n";
                return 1;
            }
            if (r.has("error")) differ(i, op, "outcome", "success", r["error"]["type"].as_string());
        } catch (const KVError& e) {
            if (!r.has("error")) differ(i, op, "outcome", e.type + ": " + e.message, "success");
            else {
                if (e.type != r["error"]["type"].as_string()) differ(i, op, "error type", e.type, r["error"]["type"].as_string());
                if (e.message != r["error"]["message"].as_string())
                    differ(i, op, "error message", e.message, r["error"]["message"].as_string());
            }
        }
        const Value& st = r["state"];
        if (ints(st["seq_lens"]) != cache.seq) differ(i, op, "state.seq_lens", join(cache.seq), join(ints(st["seq_lens"])));
        for (int s = 0; s < cache.S; ++s)
            if (ints(st["block_table"][s]) != cache.table[s])
                differ(i, op, "state.block_table[" + str(s) + "]", join(cache.table[s]), join(ints(st["block_table"][s])));
        I64 fo(cache.pool.free.begin(), cache.pool.free.end());
        if (ints(st["free_order"]) != fo) differ(i, op, "state.free_order", join(fo), join(ints(st["free_order"])));
        std::string kv = cache.kv_sha256();
        if (kv != st["kv_sha256"].as_string()) differ(i, op, "state.kv_sha256", kv, st["kv_sha256"].as_string());
        if (failures) return 1;
    }
    std::cout << vec["name"].as_string() << ": " << records.size()
              << " records replayed; every result, error and state matches\n";
    return 0;
}

static int replay_hashing(const Value& vec) {
    size_t n = 0;
    for (const Value& c : vec["cases"].items) {
        if (c["hash_algo"].as_string() != "sha256") continue;  // XXH3-128 is not part of this example
        std::string salt = c["cache_salt"].is_null() ? "" : c["cache_salt"].as_string();
        std::string parent = root_hash(c["hash_seed"].as_u64(), salt);
        if (hexs(parent) != c["root"].as_string()) differ(n, "hashing", "root", hexs(parent), c["root"].as_string());
        auto t = tokens(c["tokens"]);
        int P = int(c["block_size"].as_int());
        for (size_t i = 0; i < c["hashes"].size(); ++i) {
            parent = block_hash(parent, &t[i * P], P);
            if (hexs(parent) != c["hashes"][i].as_string())
                differ(n, "hashing", "hashes[" + str(i) + "]", hexs(parent), c["hashes"][i].as_string());
        }
        ++n;
        if (failures) return 1;
    }
    std::cout << "hashing: " << n << " sha256 cases match\n";
    return 0;
}

int main(int argc, char** argv) {
    if (argc < 2) {
        std::cerr << "usage: " << argv[0] << " VECTOR.json [VECTOR.json ...]\n";
        return 2;
    }
    int rc = 0;
    for (int f = 1; f < argc; ++f) {
        std::ifstream in(argv[f], std::ios::binary);
        if (!in) {
            std::cerr << argv[f] << ": cannot open\n";
            return 2;
        }
        std::stringstream buf;
        buf << in.rdbuf();
        try {
            Value vec = mini_json::parse(buf.str());
            const std::string api = vec["api"].as_string();
            if (api == "KVCache") rc |= replay_cache(vec);
            else if (api == "hashing") rc |= replay_hashing(vec);
            else {
                std::cerr << argv[f] << ": api " << api << " is not replayed by this example\n";
                return 2;
            }
        } catch (const std::exception& e) {
            std::cerr << argv[f] << ": " << e.what() << "\n";
            return 2;
        } catch (const KVError& e) {
            std::cerr << argv[f] << ": " << e.type << ": " << e.message << "\n";
            return 2;
        }
    }
    return rc;
}
