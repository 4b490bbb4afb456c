// C ABI shim over Gloo (Debian's libgloo-dev), used by src/backends/gloo.
//
// Rules (GS-1..3, mirrored in the Rust module docs):
// GS-1: no C++ exception crosses the C ABI: every entry point catches
//       everything and returns a nonzero code with the message in `err`.
// GS-2: rendezvous goes through the caller's store via the two callbacks
//       (set, get-with-wait), so Gloo uses Chorus's authenticated store.
// GS-3: data movement of non-reducing ops is byte-wise; reductions are typed
//       by `dtype` codes (chorus DType::code) with our own element functions,
//       which also cover the bitwise ops Gloo does not ship.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <gloo/allgatherv.h>
#include <gloo/allreduce.h>
#include <gloo/alltoallv.h>
#include <gloo/broadcast.h>
#include <gloo/gather.h>
#include <gloo/reduce.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/scatter.h>
#include <gloo/transport/tcp/device.h>

extern "C" {
typedef int (*chorus_store_set_fn)(void* ud, const char* key, const char* data, size_t len);
typedef void (*chorus_sink_fn)(void* sink, const char* data, size_t len);
typedef int (*chorus_store_get_fn)(void* ud, const char* key, void* sink, chorus_sink_fn f);
}

namespace {

void set_err(char* err, size_t errlen, const std::string& msg) {
  if (err == nullptr || errlen == 0) return;
  size_t n = std::min(errlen - 1, msg.size());
  std::memcpy(err, msg.data(), n);
  err[n] = '\0';
}

class RustStore : public gloo::rendezvous::Store {
 public:
  RustStore(void* ud, chorus_store_set_fn set, chorus_store_get_fn get)
      : ud_(ud), set_(set), get_(get) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    if (set_(ud_, key.c_str(), data.data(), data.size()) != 0) {
      throw std::runtime_error("chorus store: set(" + key + ") failed");
    }
  }
  std::vector<char> get(const std::string& key) override {
    std::vector<char> out;
    if (get_(ud_, key.c_str(), &out, &RustStore::sink) != 0) {
      throw std::runtime_error("chorus store: get(" + key + ") failed or timed out");
    }
    return out;
  }
  void wait(const std::vector<std::string>& keys) override {
    for (const auto& k : keys) (void)get(k);
  }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds&) override {
    wait(keys);
  }

 private:
  static void sink(void* s, const char* data, size_t len) {
    auto* v = static_cast<std::vector<char>*>(s);
    v->assign(data, data + len);
  }
  void* ud_;
  chorus_store_set_fn set_;
  chorus_store_get_fn get_;
};

template <typename T>
void fn_sum(void* c, const void* a, const void* b, size_t n) {
  T* o = (T*)c; const T* x = (const T*)a; const T* y = (const T*)b;
  for (size_t i = 0; i < n; i++) o[i] = x[i] + y[i];
}
template <typename T>
void fn_prod(void* c, const void* a, const void* b, size_t n) {
  T* o = (T*)c; const T* x = (const T*)a; const T* y = (const T*)b;
  for (size_t i = 0; i < n; i++) o[i] = x[i] * y[i];
}
template <typename T>
void fn_min(void* c, const void* a, const void* b, size_t n) {
  T* o = (T*)c; const T* x = (const T*)a; const T* y = (const T*)b;
  for (size_t i = 0; i < n; i++) o[i] = std::min(x[i], y[i]);
}
template <typename T>
void fn_max(void* c, const void* a, const void* b, size_t n) {
  T* o = (T*)c; const T* x = (const T*)a; const T* y = (const T*)b;
  for (size_t i = 0; i < n; i++) o[i] = std::max(x[i], y[i]);
}
template <typename T>
void fn_band(void* c, const void* a, const void* b, size_t n) {
  T* o = (T*)c; const T* x = (const T*)a; const T* y = (const T*)b;
  for (size_t i = 0; i < n; i++) o[i] = x[i] & y[i];
}
template <typename T>
void fn_bor(void* c, const void* a, const void* b, size_t n) {
  T* o = (T*)c; const T* x = (const T*)a; const T* y = (const T*)b;
  for (size_t i = 0; i < n; i++) o[i] = x[i] | y[i];
}
template <typename T>
void fn_bxor(void* c, const void* a, const void* b, size_t n) {
  T* o = (T*)c; const T* x = (const T*)a; const T* y = (const T*)b;
  for (size_t i = 0; i < n; i++) o[i] = x[i] ^ y[i];
}

typedef void (*RawFn)(void*, const void*, const void*, size_t);

// op codes: 0 sum, 1 prod, 2 min, 3 max, 4 band, 5 bor, 6 bxor.
template <typename T>
RawFn pick_int(int op) {
  switch (op) {
    case 0: return &fn_sum<T>;
    case 1: return &fn_prod<T>;
    case 2: return &fn_min<T>;
    case 3: return &fn_max<T>;
    case 4: return &fn_band<T>;
    case 5: return &fn_bor<T>;
    case 6: return &fn_bxor<T>;
    default: return nullptr;
  }
}
template <typename T>
RawFn pick_float(int op) {
  switch (op) {
    case 0: return &fn_sum<T>;
    case 1: return &fn_prod<T>;
    case 2: return &fn_min<T>;
    case 3: return &fn_max<T>;
    default: return nullptr;
  }
}

// dtype codes as chorus DType: 2 f32, 3 f64, 4 i8, 5 u8, 6 i32, 7 i64, 8 u32, 9 u64,
// 10 bool (0/1 bytes, reduced as u8 with max/min/bxor by the caller).
RawFn pick(int dtype, int op, size_t* esize) {
  switch (dtype) {
    case 2: *esize = 4; return pick_float<float>(op);
    case 3: *esize = 8; return pick_float<double>(op);
    case 4: *esize = 1; return pick_int<int8_t>(op);
    case 5: *esize = 1; return pick_int<uint8_t>(op);
    case 6: *esize = 4; return pick_int<int32_t>(op);
    case 7: *esize = 8; return pick_int<int64_t>(op);
    case 8: *esize = 4; return pick_int<uint32_t>(op);
    case 9: *esize = 8; return pick_int<uint64_t>(op);
    case 10: *esize = 1; return pick_int<uint8_t>(op);
    default: return nullptr;
  }
}

}  // namespace

struct chorus_gloo {
  std::shared_ptr<gloo::rendezvous::Context> ctx;
  std::shared_ptr<gloo::transport::Device> dev;
  std::chrono::milliseconds timeout;
};

#define GUARD_BEGIN try {
#define GUARD_END                                   \
  }                                                 \
  catch (const std::exception& e) {                 \
    set_err(err, errlen, e.what());                 \
    return 1;                                       \
  }                                                 \
  catch (...) {                                     \
    set_err(err, errlen, "unknown C++ exception");  \
    return 1;                                       \
  }                                                 \
  return 0;

extern "C" {

int chorus_gloo_connect(const char* bind_ip, int rank, int size, int64_t timeout_ms, void* ud,
                        chorus_store_set_fn set, chorus_store_get_fn get, chorus_gloo** out,
                        char* err, size_t errlen) {
  GUARD_BEGIN
  gloo::transport::tcp::attr attr(bind_ip);
  auto dev = gloo::transport::tcp::CreateDevice(attr);
  auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, size);
  ctx->setTimeout(std::chrono::milliseconds(timeout_ms));
  RustStore store(ud, set, get);
  ctx->connectFullMesh(store, dev);
  *out = new chorus_gloo{ctx, dev, std::chrono::milliseconds(timeout_ms)};
  GUARD_END
}

void chorus_gloo_free(chorus_gloo* g) {
  try {
    delete g;
  } catch (...) {
  }
}

int chorus_gloo_allreduce(chorus_gloo* g, void* buf, size_t count, int dtype, int op, uint32_t tag,
                          char* err, size_t errlen) {
  GUARD_BEGIN
  size_t es = 0;
  RawFn fn = pick(dtype, op, &es);
  if (fn == nullptr) throw std::runtime_error("unsupported dtype/op for gloo allreduce");
  gloo::AllreduceOptions opts(g->ctx);
  // Untyped pointers: size the element through a byte-sized dummy type.
  switch (es) {
    case 1: opts.setInput((uint8_t*)buf, count); opts.setOutput((uint8_t*)buf, count); break;
    case 4: opts.setInput((uint32_t*)buf, count); opts.setOutput((uint32_t*)buf, count); break;
    default: opts.setInput((uint64_t*)buf, count); opts.setOutput((uint64_t*)buf, count); break;
  }
  opts.setReduceFunction(fn);
  opts.setTag(tag);
  opts.setTimeout(g->timeout);
  gloo::allreduce(opts);
  GUARD_END
}

int chorus_gloo_reduce(chorus_gloo* g, const void* in, void* out, size_t count, int dtype, int op,
                       int root, uint32_t tag, char* err, size_t errlen) {
  GUARD_BEGIN
  size_t es = 0;
  RawFn fn = pick(dtype, op, &es);
  if (fn == nullptr) throw std::runtime_error("unsupported dtype/op for gloo reduce");
  gloo::ReduceOptions opts(g->ctx);
  switch (es) {
    case 1: opts.setInput((uint8_t*)in, count); opts.setOutput((uint8_t*)out, count); break;
    case 4: opts.setInput((uint32_t*)in, count); opts.setOutput((uint32_t*)out, count); break;
    default: opts.setInput((uint64_t*)in, count); opts.setOutput((uint64_t*)out, count); break;
  }
  opts.setRoot(root);
  opts.setReduceFunction(fn);
  opts.setTag(tag);
  opts.setTimeout(g->timeout);
  gloo::reduce(opts);
  GUARD_END
}

int chorus_gloo_broadcast(chorus_gloo* g, void* buf, size_t bytes, int root, uint32_t tag,
                          char* err, size_t errlen) {
  GUARD_BEGIN
  gloo::BroadcastOptions opts(g->ctx);
  if (g->ctx->rank == root) opts.setInput((uint8_t*)buf, bytes);
  opts.setOutput((uint8_t*)buf, bytes);
  opts.setRoot(root);
  opts.setTag(tag);
  opts.setTimeout(g->timeout);
  gloo::broadcast(opts);
  GUARD_END
}

int chorus_gloo_allgatherv(chorus_gloo* g, const void* in, size_t in_bytes, void* out,
                           const size_t* out_bytes, size_t n, uint32_t tag, char* err,
                           size_t errlen) {
  GUARD_BEGIN
  gloo::AllgathervOptions opts(g->ctx);
  opts.setInput((uint8_t*)in, in_bytes);
  opts.setOutput((uint8_t*)out, std::vector<size_t>(out_bytes, out_bytes + n));
  opts.setTag(tag);
  opts.setTimeout(g->timeout);
  gloo::allgatherv(opts);
  GUARD_END
}

int chorus_gloo_gather(chorus_gloo* g, const void* in, size_t bytes, void* out, int root,
                       uint32_t tag, char* err, size_t errlen) {
  GUARD_BEGIN
  gloo::GatherOptions opts(g->ctx);
  opts.setInput((uint8_t*)in, bytes);
  if (g->ctx->rank == root) opts.setOutput((uint8_t*)out, bytes * g->ctx->size);
  opts.setRoot(root);
  opts.setTag(tag);
  opts.setTimeout(g->timeout);
  gloo::gather(opts);
  GUARD_END
}

int chorus_gloo_scatter(chorus_gloo* g, const void* in, void* out, size_t bytes, int root,
                        uint32_t tag, char* err, size_t errlen) {
  GUARD_BEGIN
  gloo::ScatterOptions opts(g->ctx);
  if (g->ctx->rank == root) {
    std::vector<uint8_t*> ptrs;
    for (int r = 0; r < g->ctx->size; r++) ptrs.push_back((uint8_t*)in + r * bytes);
    opts.setInputs(ptrs, bytes);
  }
  opts.setOutput((uint8_t*)out, bytes);
  opts.setRoot(root);
  opts.setTag(tag);
  opts.setTimeout(g->timeout);
  gloo::scatter(opts);
  GUARD_END
}

int chorus_gloo_alltoallv(chorus_gloo* g, const void* in, const int64_t* in_bytes, void* out,
                          const int64_t* out_bytes, size_t n, uint32_t tag, char* err,
                          size_t errlen) {
  GUARD_BEGIN
  gloo::AlltoallvOptions opts(g->ctx);
  opts.setInput((uint8_t*)in, std::vector<int64_t>(in_bytes, in_bytes + n));
  opts.setOutput((uint8_t*)out, std::vector<int64_t>(out_bytes, out_bytes + n));
  opts.setTag(tag);
  opts.setTimeout(g->timeout);
  gloo::alltoallv(opts);
  GUARD_END
}

// A batch of point-to-point transfers: posts every send and receive, then
// waits for all of them. `slot` is shared by both ends (the p2p batch seq).
int chorus_gloo_p2p(chorus_gloo* g, size_t n, void* const* bufs, const size_t* bytes,
                    const int* peers, const int* is_send, uint64_t slot, char* err,
                    size_t errlen) {
  GUARD_BEGIN
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> ubs;
  for (size_t i = 0; i < n; i++) {
    auto ub = g->ctx->createUnboundBuffer(bufs[i], bytes[i]);
    if (is_send[i]) {
      ub->send(peers[i], slot);
    } else {
      ub->recv(peers[i], slot);
    }
    ubs.push_back(std::move(ub));
  }
  for (size_t i = 0; i < n; i++) {
    bool ok = is_send[i] ? ubs[i]->waitSend(g->timeout) : ubs[i]->waitRecv(g->timeout);
    if (!ok) throw std::runtime_error("gloo p2p transfer timed out");
  }
  GUARD_END
}

}  // extern "C"
