/* The product checks' compiled path: the product operators' kernels at torch's ADInplaceOrView dispatch key, the
 * sites' naming and the check of an fp32 CPU product, all in C++. From Python (the interception, the naming and
 * the check a product at a time) they cost about 25 us a product on the GPT example, more than the pass itself.
 *
 * The kernels (mm, addmm, bmm, baddbmm; registered by sdc_px_install, taken off by sdc_px_uninstall) run the
 * operator as it is, below themselves, then hand the product to every ProductChecks watching (sdc_px_watch):
 * products of the thread that entered the watch and of the autograd engine's backward. Each names the product's
 * site as sdcguard/agent/product_checks.py does (the innermost module running it, from the naming hooks'
 * sdc_px_enter / sdc_px_leave; the backward products after their forward one through the autograd node's sequence
 * number), then checks it: an fp32 CPU product whose bound it has been given (sdc_px_terms) by the fingerprint
 * library's sdc_row_verdict, which counts a failing product into its site's int64; anything else, and every
 * product of a GPU, by the Python form (the fallback callback, with the site's name). A new site's index comes
 * from Python (the site callback), so both forms share one table. The convolutions stay with the Python
 * interception, which names through sdc_px_forward_site / sdc_px_backward_site so that the two share one naming.
 *
 * Built and loaded by sdcguard.agent.native_products against the running torch's headers; the fingerprint library
 * is reached through the two function pointers handed to sdc_px_new, so that its ABI is checked in one place. */

#include <Python.h>

#include <ATen/SequenceNumber.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm_ops.h>
#include <ATen/ops/baddbmm_ops.h>
#include <ATen/ops/bmm_ops.h>
#include <ATen/ops/mm_ops.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

#include <pthread.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#define SDC_PX_ABI 3

namespace {

using RowVerdict = int (*)(const float *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, const float *,
                           int64_t, int64_t, int64_t, const float *, const float *, const float *, int64_t,
                           const float *, int64_t, int64_t, int64_t, int64_t, float, const float *, int64_t, float,
                           int, float *, double, double, double, int64_t *);
using DualMatvec = int (*)(const float *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, const float *,
                           const float *, int64_t, int, float *, float *);

enum Op { MM, ADDMM, BMM, BADDBMM };
enum Kind { FORWARD, BACKWARD, LINEAR, MATMUL, CONV };  // what ProductChecks' ``enabled`` switches (KINDS)
enum Suffix { S_FORWARD, S_RECOMPUTED, S_DX, S_DW, S_DA, S_DB };
const char *const SUFFIXES[] = {" forward", " forward (recomputed)", " backward dX", " backward dW", " backward dA",
                                " backward dB"};

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

struct Module {
    std::string label;  // its name ("<model>" for the root)
    bool linear;        // an nn.Linear
};

struct ForwardSite {
    int label;  // the module whose forward ran it
    int64_t ordinal;
    int kind;
};

struct State {
    RowVerdict verdict = nullptr;
    DualMatvec dual = nullptr;
    int isa = 0;
    PyObject *site_callback = nullptr;      // name -> index in ProductChecks.sites (registering a new one)
    PyObject *fallback_callback = nullptr;  // the Python form's check of a named product
    bool enabled[5] = {true, true, true, true, true};
    bool checking = true;  // false: products named and not checked (the benchmark's "interception alone")
    bool python_form = false;  // every product to the Python form, named there (SDCGUARD_PRODUCTS_KERNEL=python)
    int64_t *flags = nullptr;
    int64_t capacity = 0;
    int64_t step = 0;
    int64_t checked = 0, unchecked = 0;
    std::unordered_set<intptr_t> weights;
    std::map<std::tuple<int64_t, int64_t, int>, Terms> terms;
    std::map<Place, WeightSums> sums;
    std::vector<float> work, ones;
    // Naming (ProductChecks' _stack, _ordinal, _forward_sites, _node).
    std::vector<Module> modules;  // by id: 0 the root
    std::vector<int> stack;
    std::vector<int64_t> ordinals;  // by module id
    std::unordered_map<uint64_t, ForwardSite> forward_sites;
    uint64_t node = UINT64_MAX;
    int64_t node_calls = 0;
    std::unordered_map<uint64_t, int64_t> site_of;  // (label, ordinal, suffix) -> index
    std::unordered_map<std::string, int64_t> named_site_of;  // full names (a backward node with no forward site)
};

/* An error raised by a Python callback, as a C++ exception torch turns into a RuntimeError (the GIL held). */
[[noreturn]] void python_failed(const char *what) {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    std::string message = what;
    if (value != nullptr) {
        PyObject *text = PyObject_Str(value);
        if (text != nullptr) {
            const char *utf8 = PyUnicode_AsUTF8(text);
            message += ": ";
            message += utf8 != nullptr ? utf8 : "?";
            Py_DECREF(text);
        }
    }
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(traceback);
    PyErr_Clear();
    throw std::runtime_error(message);
}

/* The GIL for the scope (torch releases it around an operator). */
struct Gil {
    PyGILState_STATE state = PyGILState_Ensure();
    ~Gil() { PyGILState_Release(state); }
};

intptr_t storage_of(const at::Tensor &t) {
    return reinterpret_cast<intptr_t>(t.storage().data());
}

/* A plain fp32 CPU tensor with elements (no subclass: an FSDP2 DTensor, a fake tensor). */
bool plain(const at::Tensor &t) {
    return t.defined() && t.layout() == c10::kStrided && t.is_cpu() && t.scalar_type() == at::kFloat &&
           t.numel() != 0 && !t.key_set().has(c10::DispatchKey::Python);
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

/* c = beta bias + alpha (a @ b), checked at site: 1 checked (a failure counted into flags[site]), 2 not checkable
 * (no bound), 0 the Python form's (another dtype, device, layout, a subclass, a bound not given yet). */
int verdict(State *st, const at::Tensor &a, const at::Tensor &b, const at::Tensor &c, const at::Tensor *bias,
            double alpha, double beta, int64_t site) {
    if (st->flags == nullptr || st->verdict == nullptr || !plain(a) || !plain(b) || !plain(c) || (bias != nullptr && !plain(*bias)))
        return 0;
    int64_t dims = a.dim();
    if ((dims != 2 && dims != 3) || b.dim() != dims || c.dim() != dims)
        return 0;
    bool weight_b = st->weights.count(storage_of(b)) != 0;
    if (!weight_b && st->weights.count(storage_of(a)) != 0)
        return 0;  // the weight on the left: the Python form transposes the product
    int64_t p = a.size(-1), n = c.size(-1);
    auto found = st->terms.find({p, n, bias != nullptr ? 1 : 0});
    if (found == st->terms.end())
        return 0;
    const Terms &terms = found->second;
    if (!terms.checked)
        return 2;
    if ((a.stride(-1) != 1 && a.stride(-2) != 1) || (c.stride(-1) != 1 && c.stride(-2) != 1))
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
    int64_t batch = dims == 3 ? a.size(0) : 1, r = a.size(-2);
    const float *b_at = nullptr, *ones = nullptr, *s = nullptr, *t = nullptr;
    int64_t b_batch = 0, b_row = 0, b_col = 0;
    if (weight_b) {
        if (dims != 2)
            return 0;
        s = weight_sums(st, b);
        if (s == nullptr)
            return 0;
        t = s + p;
    } else if (b.stride(-1) == 1 || b.stride(-2) == 1) {
        b_at = b.const_data_ptr<float>();
        b_batch = dims == 3 ? b.stride(0) : 0;
        b_row = b.stride(-2);
        b_col = b.stride(-1);
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
    if (st->verdict(a.const_data_ptr<float>(), batch, r, p, dims == 3 ? a.stride(0) : 0, a.stride(-2), a.stride(-1),
                    b_at, b_batch, b_row, b_col, ones, s, t, 0, c.const_data_ptr<float>(), n,
                    dims == 3 ? c.stride(0) : 0, c.stride(-2), c.stride(-1), static_cast<float>(alpha), bias_at,
                    bias_stride, static_cast<float>(beta), st->isa, st->work.data(), terms.coefficient,
                    terms.absolute, terms.limit, st->flags + index) != 0)
        return 0;
    return 1;
}

std::string base_name(const State *st, int label, int64_t ordinal) {
    std::string base = st->modules[label].label;
    if (ordinal != 0)
        base += " #" + std::to_string(ordinal);
    return base;
}

/* The index of the site named base + suffix: from the cache, else from Python (which registers it). */
int64_t site_index(State *st, uint64_t key, const std::string &name, bool by_name) {
    if (by_name) {
        auto found = st->named_site_of.find(name);
        if (found != st->named_site_of.end())
            return found->second;
    } else {
        auto found = st->site_of.find(key);
        if (found != st->site_of.end())
            return found->second;
    }
    Gil gil;
    PyObject *index = PyObject_CallFunction(st->site_callback, "s", name.c_str());
    if (index == nullptr)
        python_failed("sdcguard product checks: naming a site failed");
    int64_t value = PyLong_AsLongLong(index);
    Py_DECREF(index);
    if (by_name)
        st->named_site_of[name] = value;
    else
        st->site_of[key] = value;
    return value;
}

PyObject *wrap(const at::Tensor *t) {
    if (t == nullptr || !t->defined()) {
        Py_INCREF(Py_None);
        return Py_None;
    }
    return THPVariable_Wrap(*t);
}

/* The Python form's check of a product (site: its name, or null to have Python name it too). */
void to_python(State *st, Op op, const at::Tensor &a, const at::Tensor &b, const at::Tensor *bias, double alpha,
               double beta, const at::Tensor &out, const char *site) {
    Gil gil;
    PyObject *args[] = {wrap(&a), wrap(&b), wrap(bias), wrap(&out)};
    PyObject *result = site != nullptr
        ? PyObject_CallFunction(st->fallback_callback, "iOOOddOs", static_cast<int>(op), args[0], args[1], args[2],
                                alpha, beta, args[3], site)
        : PyObject_CallFunction(st->fallback_callback, "iOOOddOO", static_cast<int>(op), args[0], args[1], args[2],
                                alpha, beta, args[3], Py_None);
    for (PyObject *arg : args)
        Py_XDECREF(arg);
    if (result == nullptr)
        python_failed("sdcguard product checks: the Python form's check failed");
    Py_DECREF(result);
}

/* One product of a watching ProductChecks: named, then checked here or by the Python form. */
void on_product(State *st, Op op, const at::Tensor &a, const at::Tensor &b, const at::Tensor *bias, double alpha,
                double beta, const at::Tensor &out, const torch::autograd::Node *node) {
    if (st->python_form) {
        to_python(st, op, a, b, bias, alpha, beta, out, nullptr);
        return;
    }
    std::string name;
    uint64_t key;
    bool by_name = false;
    // A module's forward running inside a backward node is activation checkpointing's recomputation: its
    // products are forward products (and must not count as the node's own backward products).
    bool recomputed = node != nullptr && !st->stack.empty();
    if (node == nullptr || recomputed) {
        if (!st->enabled[FORWARD])
            return;
        int top = st->stack.empty() ? -1 : st->stack.back();
        int label = top < 0 ? 0 : top;
        int64_t ordinal = st->ordinals[label]++;
        int kind = top >= 0 && st->modules[top].linear && ordinal == 0 ? LINEAR : MATMUL;
        if (!st->enabled[kind])
            return;
        if (c10::GradMode::is_enabled() &&
            (a.requires_grad() || b.requires_grad() || (bias != nullptr && bias->requires_grad())))
            // Its autograd node was made just before it ran: its sequence number is the last.
            st->forward_sites[at::sequence_number::peek() - 1] = ForwardSite{label, ordinal, kind};
        int suffix = recomputed ? S_RECOMPUTED : S_FORWARD;
        key = (static_cast<uint64_t>(label) << 40) | (static_cast<uint64_t>(ordinal) << 8) | suffix;
        if (st->site_of.find(key) == st->site_of.end())
            name = base_name(st, label, ordinal) + SUFFIXES[suffix];
    } else {
        if (!st->enabled[BACKWARD])
            return;
        uint64_t seq = node->sequence_nr();
        auto forward = st->forward_sites.find(seq);
        int kind = forward == st->forward_sites.end() ? MATMUL : forward->second.kind;
        if (!st->enabled[kind])
            return;
        int64_t calls = st->node == seq ? st->node_calls + 1 : 1;
        st->node = seq;
        st->node_calls = calls;
        // Whether this is the gradient of the forward product's left operand. Autograd's formulas
        // (derivatives.yaml) compute the inputs' gradients in argument order, and only those of inputs that need
        // one; the shapes cannot tell (a transposed layout, square operands).
        const auto &edges = node->next_edges();
        size_t first = edges.size() == 3 ? 1 : 0;  // addmm/baddbmm: (bias, left, right); mm/bmm: (left, right)
        std::vector<size_t> needed;
        for (size_t i = first; i < first + 2 && i < edges.size(); i++)
            if (edges[i].is_valid())
                needed.push_back(i);
        bool left = calls <= static_cast<int64_t>(needed.size()) && needed[calls - 1] == first;
        int suffix = kind == LINEAR ? (left ? S_DX : S_DW) : (left ? S_DA : S_DB);
        if (forward == st->forward_sites.end()) {
            by_name = true;
            key = 0;
            name = "<" + node->name() + ">" + SUFFIXES[suffix];
        } else {
            const ForwardSite &f = forward->second;
            key = (static_cast<uint64_t>(f.label) << 40) | (static_cast<uint64_t>(f.ordinal) << 8) | suffix;
            if (st->site_of.find(key) == st->site_of.end())
                name = base_name(st, f.label, f.ordinal) + SUFFIXES[suffix];
        }
    }
    if (!st->checking)
        return;
    int answer = 0;
    if (plain(a) && plain(b) && plain(out)) {
        int64_t site = site_index(st, key, name, by_name);
        answer = verdict(st, a, b, out, bias, alpha, beta, site);
        if (answer == 1) {
            st->checked += 1;
            return;
        }
        if (answer == 2) {
            st->unchecked += 1;
            return;
        }
    }
    if (name.empty())  // a site named before: its name again, for Python
        name = base_name(st, static_cast<int>(key >> 40), static_cast<int64_t>((key >> 8) & 0xffffffff)) +
               SUFFIXES[key & 0xff];
    to_python(st, op, a, b, bias, alpha, beta, out, name.c_str());
}

// -- the interception ---------------------------------------------------------------------------------------------

std::vector<State *> watchers;
std::vector<pthread_t> watching_threads;  // the thread of each watch entered (one per entry of watchers)
std::unique_ptr<torch::Library> registration;

void seen(Op op, const at::Tensor &a, const at::Tensor &b, const at::Tensor *bias, const c10::Scalar &beta,
          const c10::Scalar &alpha, const at::Tensor &out) {
    if (watchers.empty())
        return;
    auto node = torch::autograd::get_current_node();
    if (node == nullptr && !pthread_equal(pthread_self(), watching_threads.back()))
        return;  // another thread's product (a data loader's, a metric's) is not this rank's pass
    double alpha_value = alpha.toDouble(), beta_value = beta.toDouble();
    if (watchers.size() == 1) {
        on_product(watchers.back(), op, a, b, bias, alpha_value, beta_value, out, node.get());
        return;
    }
    // Innermost first, as nested modes would see it (a copy: a callback may leave a watch).
    std::vector<State *> now(watchers.rbegin(), watchers.rend());
    for (State *st : now)
        on_product(st, op, a, b, bias, alpha_value, beta_value, out, node.get());
}

const c10::Scalar ONE(1);

at::Tensor mm_kernel(c10::DispatchKeySet keys, const at::Tensor &a, const at::Tensor &b) {
    at::Tensor out = at::_ops::mm::redispatch(keys & c10::after_ADInplaceOrView_keyset, a, b);
    seen(MM, a, b, nullptr, ONE, ONE, out);
    return out;
}

at::Tensor bmm_kernel(c10::DispatchKeySet keys, const at::Tensor &a, const at::Tensor &b) {
    at::Tensor out = at::_ops::bmm::redispatch(keys & c10::after_ADInplaceOrView_keyset, a, b);
    seen(BMM, a, b, nullptr, ONE, ONE, out);
    return out;
}

at::Tensor addmm_kernel(c10::DispatchKeySet keys, const at::Tensor &bias, const at::Tensor &a, const at::Tensor &b,
                        const c10::Scalar &beta, const c10::Scalar &alpha) {
    at::Tensor out = at::_ops::addmm::redispatch(keys & c10::after_ADInplaceOrView_keyset, bias, a, b, beta, alpha);
    seen(ADDMM, a, b, &bias, beta, alpha, out);
    return out;
}

at::Tensor baddbmm_kernel(c10::DispatchKeySet keys, const at::Tensor &bias, const at::Tensor &a,
                          const at::Tensor &b, const c10::Scalar &beta, const c10::Scalar &alpha) {
    at::Tensor out =
        at::_ops::baddbmm::redispatch(keys & c10::after_ADInplaceOrView_keyset, bias, a, b, beta, alpha);
    seen(BADDBMM, a, b, &bias, beta, alpha, out);
    return out;
}

}  // namespace

extern "C" {

int sdc_px_abi(void) { return SDC_PX_ABI; }

/* The kernels at ADInplaceOrView for the four operators; 0, or -1 (a Python error set) where torch refused. */
int sdc_px_install(void) {
    try {
        auto library = std::make_unique<torch::Library>(torch::Library::IMPL, "aten",
                                                        c10::DispatchKey::ADInplaceOrView, __FILE__, __LINE__);
        library->impl("mm", TORCH_FN(mm_kernel));
        library->impl("bmm", TORCH_FN(bmm_kernel));
        library->impl("addmm", TORCH_FN(addmm_kernel));
        library->impl("baddbmm", TORCH_FN(baddbmm_kernel));
        registration = std::move(library);
        return 0;
    } catch (const std::exception &exc) {
        PyErr_SetString(PyExc_RuntimeError, exc.what());
        return -1;
    }
}

void sdc_px_uninstall(void) { registration.reset(); }

void sdc_px_watch(void *state) {
    watchers.push_back(static_cast<State *>(state));
    watching_threads.push_back(pthread_self());
}

void sdc_px_unwatch(void *state) {
    for (size_t i = watchers.size(); i-- > 0;) {
        if (watchers[i] == state) {
            watchers.erase(watchers.begin() + i);
            watching_threads.erase(watching_threads.begin() + i);
            return;
        }
    }
}

void *sdc_px_new(void *verdict_at, void *dual_at, int isa, PyObject *site_callback, PyObject *fallback_callback) {
    auto *st = new State();
    st->verdict = reinterpret_cast<RowVerdict>(verdict_at);
    st->dual = reinterpret_cast<DualMatvec>(dual_at);
    st->isa = isa;
    Py_INCREF(site_callback);
    Py_INCREF(fallback_callback);
    st->site_callback = site_callback;
    st->fallback_callback = fallback_callback;
    st->modules.push_back(Module{"<model>", false});
    st->ordinals.push_back(0);
    return st;
}

/* The fingerprint library's passes to check with (null: every product to the Python form). */
void sdc_px_kernel(void *state, void *verdict_at, void *dual_at, int isa) {
    auto *st = static_cast<State *>(state);
    st->verdict = reinterpret_cast<RowVerdict>(verdict_at);
    st->dual = reinterpret_cast<DualMatvec>(dual_at);
    st->isa = isa;
}

void sdc_px_free(void *state) {
    auto *st = static_cast<State *>(state);
    sdc_px_unwatch(st);
    Py_XDECREF(st->site_callback);
    Py_XDECREF(st->fallback_callback);
    delete st;
}

/* Module ids: 0 is the root (registered by sdc_px_new: call with id 0 to say whether it is an nn.Linear), then
 * 1, 2, ... in order. */
void sdc_px_module(void *state, int id, const char *label, int linear) {
    auto *st = static_cast<State *>(state);
    if (id == 0) {
        st->modules[0].linear = linear != 0;
        return;
    }
    st->modules.push_back(Module{label, linear != 0});
    st->ordinals.push_back(0);
}

void sdc_px_enabled(void *state, int forward, int backward, int linear, int matmul, int conv, int checking,
                    int python_form) {
    auto *st = static_cast<State *>(state);
    st->python_form = python_form != 0;
    st->enabled[FORWARD] = forward != 0;
    st->enabled[BACKWARD] = backward != 0;
    st->enabled[LINEAR] = linear != 0;
    st->enabled[MATMUL] = matmul != 0;
    st->enabled[CONV] = conv != 0;
    st->checking = checking != 0;
}

/* A module's forward begins (a naming hook): on an empty stack the root starts a pass (every pass names its
 * products alike) and any other module is activation checkpointing recomputing it in the backward (its products
 * named as in its forward). */
void sdc_px_enter(void *state, int id) {
    auto *st = static_cast<State *>(state);
    if (st->stack.empty()) {
        if (id == 0) {
            std::fill(st->ordinals.begin(), st->ordinals.end(), 0);
        } else {
            const std::string &name = st->modules[id].label, prefix = name + ".";
            for (size_t i = 1; i < st->modules.size(); i++) {
                const std::string &other = st->modules[i].label;
                if (other == name || other.compare(0, prefix.size(), prefix) == 0)
                    st->ordinals[i] = 0;
            }
        }
    }
    st->stack.push_back(id);
}

void sdc_px_leave(void *state) {
    auto *st = static_cast<State *>(state);
    if (!st->stack.empty())
        st->stack.pop_back();
}

void sdc_px_end_pass(void *state) { static_cast<State *>(state)->stack.clear(); }

/* A convolution's forward product (the Python interception's): its label and ordinal, its kind in *kind, its
 * forward site recorded where requires_grad; -1 where forward products or its kind are switched off. The stack
 * depth is in *depth (a recomputation where a backward node runs it). */
int sdc_px_forward_site(void *state, int requires_grad, int64_t *ordinal, int64_t *depth) {
    auto *st = static_cast<State *>(state);
    *depth = static_cast<int64_t>(st->stack.size());
    if (!st->enabled[FORWARD])
        return -1;
    int top = st->stack.empty() ? -1 : st->stack.back();
    int label = top < 0 ? 0 : top;
    *ordinal = st->ordinals[label]++;
    if (!st->enabled[CONV])
        return -1;
    if (requires_grad && c10::GradMode::is_enabled())
        st->forward_sites[at::sequence_number::peek() - 1] = ForwardSite{label, *ordinal, CONV};
    return label;
}

/* The forward site of a backward node's sequence number: its label (its ordinal in *ordinal, kind in *kind), or
 * -1 where there is none. */
int sdc_px_backward_site(void *state, uint64_t seq, int64_t *ordinal, int *kind) {
    auto *st = static_cast<State *>(state);
    auto found = st->forward_sites.find(seq);
    if (found == st->forward_sites.end())
        return -1;
    *ordinal = found->second.ordinal;
    *kind = found->second.kind;
    return found->second.label;
}

/* A product of the backward node seq (the Python interception's): how many of its products this is, counted
 * with the matrix products' (as on_product counts them). */
int64_t sdc_px_node_call(void *state, uint64_t seq) {
    auto *st = static_cast<State *>(state);
    int64_t calls = st->node == seq ? st->node_calls + 1 : 1;
    st->node = seq;
    st->node_calls = calls;
    return calls;
}

int64_t sdc_px_depth(void *state) { return static_cast<int64_t>(static_cast<State *>(state)->stack.size()); }

/* A new step: its flags (capacity int64 per site), its weights' storages, and the weight sums of past steps stale;
 * the forward sites and the counts forgotten. */
void sdc_px_begin_step(void *state, int64_t *flags, int64_t capacity, const int64_t *weights, int64_t count,
                       int64_t keep) {
    auto *st = static_cast<State *>(state);
    st->flags = flags;
    st->capacity = capacity;
    st->step += 1;
    st->checked = st->unchecked = 0;
    st->forward_sites.clear();
    st->weights.clear();
    for (int64_t i = 0; i < count; i++)
        st->weights.insert(static_cast<intptr_t>(weights[i]));
    if (static_cast<int64_t>(st->sums.size()) > keep)
        st->sums.clear();  // storages that moved (FSDP2 unshards into fresh ones): keep the live ones
}

/* Products checked and not checkable here since the step began. */
void sdc_px_counts(void *state, int64_t *out) {
    auto *st = static_cast<State *>(state);
    out[0] = st->checked;
    out[1] = st->unchecked;
}

/* Forget the bounds (torch's rounding settings changed). */
void sdc_px_forget_terms(void *state) { static_cast<State *>(state)->terms.clear(); }

/* The bound of an fp32 CPU product of p-long accumulations into n columns (with a bias or not), as the Python
 * form computed it: checked 0 where no bound applies. */
void sdc_px_terms(void *state, int64_t p, int64_t n, int bias, int checked, double coefficient, double absolute,
                  double limit) {
    static_cast<State *>(state)->terms[{p, n, bias}] = Terms{checked != 0, coefficient, absolute, limit};
}

/* The passes taken out (benchmarks/bench_products.py's "passes skipped" row): every product passes at once. */
int sdc_px_skipped_verdict(const float *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, const float *,
                           int64_t, int64_t, int64_t, const float *, const float *, const float *, int64_t,
                           const float *, int64_t, int64_t, int64_t, int64_t, float, const float *, int64_t, float,
                           int, float *, double, double, double, int64_t *) { return 0; }
int sdc_px_skipped_dual(const float *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, const float *,
                        const float *, int64_t, int, float *, float *) { return 0; }

}  // extern "C"
