/* The product checks' compiled path: one call per product from ProductChecks' Python, where that Python took a
 * dozen tensor queries, a lookup of the weight's row sums and a 30-argument ctypes call (about 10 us a product on
 * the GPT example, more than the pass itself).
 *
 * sdc_px_check takes the product's tensors as Python objects, finds whether an operand is a weight of the step
 * (the operand taken by rows is then the weight: its row sums are computed once a step, both layouts, and kept),
 * and hands the whole check to the fingerprint library's sdc_row_verdict, which counts a failing product into its
 * site's int64. It answers the fp32 CPU products with a bound it was given (sdc_px_terms); anything else is the
 * Python form's (answer 0), as is every product where this library is not built (no C++ compiler, no Python
 * headers): the checks then cost more and check the same.
 *
 * Built and loaded by sdcguard.agent.native_products against the running torch's headers; the fingerprint library
 * is reached through the two function pointers handed to sdc_px_new, so that its ABI is checked in one place. */

#include <Python.h>

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <map>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#define SDC_PX_ABI 1

namespace {

using RowVerdict = int (*)(const float *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, const float *,
                           int64_t, int64_t, int64_t, const float *, const float *, const float *, int64_t,
                           const float *, int64_t, int64_t, int64_t, int64_t, float, const float *, int64_t, float,
                           int, float *, double, double, double, int64_t *);
using DualMatvec = int (*)(const float *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, const float *,
                           const float *, int64_t, int, float *, float *);

struct Terms {
    bool checked;  // false: no bound applies (the product is counted unchecked)
    double coefficient, absolute, limit;
};

/* Where a weight's values lie: its storage, offset and 2-D layout (rows x cols, strides). */
using Place = std::tuple<intptr_t, int64_t, int64_t, int64_t, int64_t, int64_t>;

struct WeightSums {
    int64_t step = -1;     // the step they were computed in (valid for that step and version only)
    int64_t version = -1;  // the tensor's version counter then
    std::vector<float> rows;     // B 1 then |B| 1 over the place's rows
    std::vector<float> columns;  // the same over its columns (the transposed layout)
};

struct State {
    RowVerdict verdict;
    DualMatvec dual;
    int isa;
    PyTypeObject *tensor_type, *parameter_type;
    int64_t *flags = nullptr;
    int64_t capacity = 0;
    int64_t step = 0;
    std::unordered_set<intptr_t> weights;
    std::map<std::tuple<int64_t, int64_t, int>, Terms> terms;
    std::map<Place, WeightSums> sums;
    std::vector<float> work, ones;
};

bool plain(State *st, PyObject *obj, const at::Tensor *&out) {
    PyTypeObject *type = Py_TYPE(obj);
    if (type != st->tensor_type && type != st->parameter_type)
        return false;
    const at::Tensor &t = THPVariable_Unpack(obj);
    if (!t.defined() || t.layout() != c10::kStrided || !t.is_cpu() || t.scalar_type() != at::kFloat ||
        t.numel() == 0 || t.key_set().has(c10::DispatchKey::Python))
        return false;
    out = &t;
    return true;
}

intptr_t storage_of(const at::Tensor &t) {
    return reinterpret_cast<intptr_t>(t.storage().data());
}

/* The row sums and absolute row sums of the weight b (p x n, 2-D), for this step: computed once, both layouts,
 * into buffers kept for its place. Null where b's layout has no unit stride. */
const float *weight_sums(State *st, const at::Tensor &b) {
    int64_t rows = b.size(0), cols = b.size(1), rs = b.stride(0), cs = b.stride(1);
    if (rs != 1 && cs != 1)
        return nullptr;
    intptr_t storage = storage_of(b);
    int64_t offset = b.storage_offset(), version = b._version();
    auto fresh = [&](const WeightSums &w) { return w.step == st->step && w.version == version; };
    auto found = st->sums.find(Place{storage, offset, rows, cols, rs, cs});
    if (found != st->sums.end() && fresh(found->second) && !found->second.rows.empty())
        return found->second.rows.data();
    auto across = st->sums.find(Place{storage, offset, cols, rows, cs, rs});
    if (across != st->sums.end() && fresh(across->second) && !across->second.columns.empty())
        return across->second.columns.data();
    WeightSums &w = found != st->sums.end() ? found->second : st->sums[Place{storage, offset, rows, cols, rs, cs}];
    w.rows.resize(2 * rows);
    w.columns.resize(2 * cols);
    if (static_cast<int64_t>(st->ones.size()) < std::max(rows, cols))
        st->ones.assign(std::max(rows, cols), 1.0f);
    const float *data = b.const_data_ptr<float>(), *ones = st->ones.data();
    if (st->dual(data, 1, rows, cols, 0, rs, cs, ones, ones, 0, st->isa, w.rows.data(), w.rows.data() + rows) != 0 ||
        st->dual(data, 1, cols, rows, 0, cs, rs, ones, ones, 0, st->isa, w.columns.data(),
                 w.columns.data() + cols) != 0)
        return nullptr;
    w.step = st->step;
    w.version = version;
    return w.rows.data();
}

}  // namespace

extern "C" {

int sdc_px_abi(void) { return SDC_PX_ABI; }

void *sdc_px_new(void *verdict, void *dual, int isa, PyObject *tensor_type, PyObject *parameter_type) {
    auto *st = new State();
    st->verdict = reinterpret_cast<RowVerdict>(verdict);
    st->dual = reinterpret_cast<DualMatvec>(dual);
    st->isa = isa;
    st->tensor_type = reinterpret_cast<PyTypeObject *>(tensor_type);
    st->parameter_type = reinterpret_cast<PyTypeObject *>(parameter_type);
    return st;
}

void sdc_px_free(void *state) { delete static_cast<State *>(state); }

/* A new step: its flags (capacity int64 per site), its weights' storages, and the weight sums of past steps stale. */
void sdc_px_begin_step(void *state, int64_t *flags, int64_t capacity, const int64_t *weights, int64_t count,
                       int64_t keep) {
    auto *st = static_cast<State *>(state);
    st->flags = flags;
    st->capacity = capacity;
    st->step += 1;
    st->weights.clear();
    for (int64_t i = 0; i < count; i++)
        st->weights.insert(static_cast<intptr_t>(weights[i]));
    if (static_cast<int64_t>(st->sums.size()) > keep)
        st->sums.clear();  // storages that moved (FSDP2 unshards into fresh ones): keep the live ones
}

/* Forget the bounds (torch's rounding settings changed). */
void sdc_px_forget_terms(void *state) { static_cast<State *>(state)->terms.clear(); }

/* The bound of an fp32 CPU product of p-long accumulations into n columns (with a bias or not), as the Python
 * form computed it: checked 0 where no bound applies. */
void sdc_px_terms(void *state, int64_t p, int64_t n, int bias, int checked, double coefficient, double absolute,
                  double limit) {
    static_cast<State *>(state)->terms[{p, n, bias}] = Terms{checked != 0, coefficient, absolute, limit};
}

/* c = beta bias + alpha (a @ b), checked: 1 checked (a failure counted into flags[site]), 2 not checkable (no
 * bound), 0 the Python form's (another dtype, device, layout, a subclass, a bound not given yet). */
int sdc_px_check(void *state, PyObject *a_obj, PyObject *b_obj, PyObject *c_obj, PyObject *bias_obj, double alpha,
                 double beta, int64_t site) {
    auto *st = static_cast<State *>(state);
    const at::Tensor *a, *b, *c, *bias = nullptr;
    if (st->flags == nullptr || !plain(st, a_obj, a) || !plain(st, b_obj, b) || !plain(st, c_obj, c))
        return 0;
    if (bias_obj != Py_None && !plain(st, bias_obj, bias))
        return 0;
    int64_t dims = a->dim();
    if ((dims != 2 && dims != 3) || b->dim() != dims || c->dim() != dims)
        return 0;
    bool weight_b = st->weights.count(storage_of(*b)) != 0;
    if (!weight_b && st->weights.count(storage_of(*a)) != 0)
        return 0;  // the weight on the left: the Python form transposes the product
    int64_t p = a->size(-1), n = c->size(-1);
    auto found = st->terms.find({p, n, bias != nullptr ? 1 : 0});
    if (found == st->terms.end())
        return 0;
    const Terms &terms = found->second;
    if (!terms.checked)
        return 2;
    if ((a->stride(-1) != 1 && a->stride(-2) != 1) || (c->stride(-1) != 1 && c->stride(-2) != 1))
        return 0;
    const float *bias_at = nullptr;
    int64_t bias_stride = 0;
    if (bias != nullptr && beta != 0) {
        // Only a bias broadcast along the rows (an nn.Linear's): one row of n, or one value.
        int64_t last = bias->size(-1);
        if (bias->numel() != last || (last != 1 && last != n))
            return 0;
        bias_at = bias->const_data_ptr<float>();
        bias_stride = last > 1 ? bias->stride(-1) : 0;
    }
    int64_t batch = dims == 3 ? a->size(0) : 1, r = a->size(-2);
    const float *b_at = nullptr, *ones = nullptr, *s = nullptr, *t = nullptr;
    int64_t b_batch = 0, b_row = 0, b_col = 0;
    if (weight_b) {
        if (dims != 2)
            return 0;
        s = weight_sums(st, *b);
        if (s == nullptr)
            return 0;
        t = s + p;
    } else if (b->stride(-1) == 1 || b->stride(-2) == 1) {
        b_at = b->const_data_ptr<float>();
        b_batch = dims == 3 ? b->stride(0) : 0;
        b_row = b->stride(-2);
        b_col = b->stride(-1);
        if (static_cast<int64_t>(st->ones.size()) < n)
            st->ones.assign(n, 1.0f);
        ones = st->ones.data();
    } else {
        return 0;
    }
    size_t needed = static_cast<size_t>(r + 2 * batch * (r + p));
    if (st->work.size() < needed)
        st->work.resize(needed);
    int64_t index = site < st->capacity ? site : st->capacity - 1;
    if (st->verdict(a->const_data_ptr<float>(), batch, r, p, dims == 3 ? a->stride(0) : 0, a->stride(-2),
                    a->stride(-1), b_at, b_batch, b_row, b_col, ones, s, t, 0, c->const_data_ptr<float>(), n,
                    dims == 3 ? c->stride(0) : 0, c->stride(-2), c->stride(-1), static_cast<float>(alpha), bias_at,
                    bias_stride, static_cast<float>(beta), st->isa, st->work.data(), terms.coefficient,
                    terms.absolute, terms.limit, st->flags + index) != 0)
        return 0;
    return 1;
}

/* The passes taken out (benchmarks/bench_products.py's "passes skipped" row): every product passes at once. */
int sdc_px_skipped_verdict(const float *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, const float *,
                           int64_t, int64_t, int64_t, const float *, const float *, const float *, int64_t,
                           const float *, int64_t, int64_t, int64_t, int64_t, float, const float *, int64_t, float,
                           int, float *, double, double, double, int64_t *) { return 0; }
int sdc_px_skipped_dual(const float *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, const float *,
                        const float *, int64_t, int, float *, float *) { return 0; }

}  // extern "C"
