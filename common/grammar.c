/* grammar.c - the llguidance binding (see grammar.h).
 *
 * Only the handful of llg_* entry points used here are resolved.  The structures passed to
 * the library mirror llguidance's C API (parser/llguidance.h of llguidance 1.x): the
 * constraint init (with its parser limits) and the v2 tokenizer init, which carries its own
 * size so newer libraries read only the fields this file knows.
 */
#include <dlfcn.h>
#include <errno.h>
#include <glob.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "file.h"
#include "grammar.h"

#ifndef STEPD_SOURCE_ROOT
#define STEPD_SOURCE_ROOT ""
#endif

struct llg_limits {
    size_t max_items_in_row;
    uint64_t initial_lexer_fuel;
    uint64_t step_lexer_fuel;
    size_t step_max_items;
    size_t max_lexer_states;
    size_t max_grammar_size;
    bool precompute_large_lexemes;
    bool verbose_errors;
};

struct llg_init {
    const void *tokenizer;
    uint32_t log_buffer_level;
    uint32_t log_stderr_level;
    bool ff_tokens_ok;
    bool backtrack_ok;
    struct llg_limits limits;
};

struct llg_tok_init2 {
    size_t struct_size;
    uint32_t vocab_size;
    uint32_t tok_eos;
    const uint32_t *token_lens;
    const uint8_t *token_bytes;
    const char *tokenizer_json;
    bool tokenize_assumes_string;
    void *tokenize_fn;
    bool use_approximate_greedy_tokenize_fn;
    const void *tokenize_user_data;
    const char *const *slices;
    const uint32_t *tok_eos_extra;
    uint32_t tok_eos_extra_count;
};

static struct {
    void (*init_defaults)(struct llg_init *, const void *tok);
    void *(*new_tokenizer_v2)(const struct llg_tok_init2 *, char *, size_t);
    void (*free_tokenizer)(void *);
    int32_t (*validate)(const struct llg_init *, const char *, const char *, char *, size_t);
    void *(*new_matcher)(const struct llg_init *, const char *, const char *);
    void (*free_matcher)(void *);
    const char *(*matcher_error)(void *);
    size_t (*mask_bytes)(const void *);
    int32_t (*mask_into)(void *, uint32_t *, size_t);
    int32_t (*consume)(void *, uint32_t);
    int32_t (*rollback)(void *, size_t);
    bool (*is_stopped)(const void *);
} llg;

static pthread_once_t lib_once = PTHREAD_ONCE_INIT;
static int lib_rc;
static char lib_msg[512];

static void *lib_try(const char *path)
{
    return path && *path ? dlopen(path, RTLD_NOW | RTLD_LOCAL) : NULL;
}

/* The wheel's library is also llguidance's Python extension (abi3): its Python symbols are
 * bound at load time although the llg_* C API never calls them, so a Python runtime library
 * is loaded first to satisfy them (the Debian package libpython3.11; any 3.x will do). */
static void python_runtime(void)
{
    static const char *const names[] = {
        "libpython3.so", "libpython3.13.so.1.0", "libpython3.12.so.1.0", "libpython3.11.so.1.0",
        "libpython3.10.so.1.0", "libpython3.9.so.1.0", NULL,
    };
    for (int i = 0; names[i]; i++)
        if (dlopen(names[i], RTLD_NOW | RTLD_GLOBAL))
            return;
}

static void lib_load(void)
{
    const char *env = getenv("STEPD_LLGUIDANCE");
    void *dl;

    python_runtime();
    dl = lib_try(env);

    if (!dl && env && *env) {
        lib_rc = -ENOENT;
        snprintf(lib_msg, sizeof(lib_msg), "structured output needs llguidance: "
                 "STEPD_LLGUIDANCE=%s: %s", env, dlerror());
        return;
    }
    if (!dl && STEPD_SOURCE_ROOT[0]) {
        glob_t g;
        if (!glob(STEPD_SOURCE_ROOT "/.venv/lib/python3*/site-packages/llguidance/_lib.abi3.so",
                  0, NULL, &g)) {
            for (size_t i = 0; !dl && i < g.gl_pathc; i++)
                dl = lib_try(g.gl_pathv[i]);
        }
        globfree(&g);
    }
    if (!dl)
        dl = lib_try("libllguidance.so");
    if (!dl) {
        lib_rc = -ENOENT;
        snprintf(lib_msg, sizeof(lib_msg), "structured output needs llguidance, which is not "
                 "installed (pip install llguidance, then set STEPD_LLGUIDANCE to its _lib.abi3.so)");
        return;
    }
#define SYM(field, name)                                                                  \
    if (!(*(void **) &llg.field = dlsym(dl, name))) {                                     \
        lib_rc = -ENOEXEC;                                                                \
        snprintf(lib_msg, sizeof(lib_msg), "structured output needs llguidance: the "     \
                 "library has no %s (too old?)", name);                                   \
        dlclose(dl);                                                                      \
        return;                                                                           \
    }
    SYM(init_defaults, "llg_constraint_init_set_defaults");
    SYM(new_tokenizer_v2, "llg_new_tokenizer_v2");
    SYM(free_tokenizer, "llg_free_tokenizer");
    SYM(validate, "llg_validate_grammar");
    SYM(new_matcher, "llg_new_matcher");
    SYM(free_matcher, "llg_free_matcher");
    SYM(matcher_error, "llg_matcher_get_error");
    SYM(mask_bytes, "llg_matcher_get_mask_byte_size");
    SYM(mask_into, "llg_matcher_compute_mask_into");
    SYM(consume, "llg_matcher_consume_token");
    SYM(rollback, "llg_matcher_rollback");
    SYM(is_stopped, "llg_matcher_is_stopped");
#undef SYM
}

int grammar_lib_open(struct err_buf *err)
{
    pthread_once(&lib_once, lib_load);
    if (lib_rc < 0)
        return err_set(err, lib_rc, "%s", lib_msg);
    return 0;
}

struct grammar_vocab {
    void *tok;
    int n_vocab;
};

int grammar_vocab_new(const char *tokenizer_json, int n_vocab, const int32_t *eos, int n_eos,
                      struct grammar_vocab **ret, struct err_buf *err)
{
    char *json = NULL, msg[512] = "";
    size_t len;
    uint32_t extra[8];
    int r;

    if ((r = grammar_lib_open(err)) < 0)
        return r;
    if (n_eos < 1 || n_eos > 9 || n_vocab < 1)
        return err_set(err, -EINVAL, "grammar vocabulary: need 1..9 end ids and a vocabulary");
    r = file_read_all(tokenizer_json, 256u << 20, 0, &json, &len);
    if (r < 0)
        return err_set(err, r, "%s: %s", tokenizer_json, strerror(-r));
    for (int i = 1; i < n_eos; i++)
        extra[i - 1] = (uint32_t) eos[i];
    struct llg_tok_init2 ti = {
        .struct_size = sizeof(ti),
        .vocab_size = (uint32_t) n_vocab,
        .tok_eos = (uint32_t) eos[0],
        .tokenizer_json = json,
        .use_approximate_greedy_tokenize_fn = true,
        .tok_eos_extra = n_eos > 1 ? extra : NULL,
        .tok_eos_extra_count = (uint32_t) (n_eos - 1),
    };
    void *tok = llg.new_tokenizer_v2(&ti, msg, sizeof(msg));
    free(json);
    if (!tok)
        return err_set(err, -EINVAL, "%s: llguidance refused the tokenizer: %s", tokenizer_json, msg);
    struct grammar_vocab *v = calloc(1, sizeof(*v));
    if (!v) {
        llg.free_tokenizer(tok);
        return err_set(err, -ENOMEM, "out of memory");
    }
    v->tok = tok;
    v->n_vocab = n_vocab;
    *ret = v;
    return 0;
}

void grammar_vocab_free(struct grammar_vocab *v)
{
    if (!v)
        return;
    llg.free_tokenizer(v->tok);
    free(v);
}

static void init_of(const struct grammar_vocab *v, struct llg_init *in)
{
    memset(in, 0, sizeof(*in));
    llg.init_defaults(in, v->tok);
    in->log_buffer_level = 0;
    in->log_stderr_level = 0;
    in->limits.verbose_errors = false;
}

/* JSON is compact (no free whitespace between tokens, which a model can repeat until
 * max_tokens): a schema object without its own "x-guidance" options gets whitespace_flexible
 * false.  json_object is the schema {"type": "object"}.  *owned: text to free. */
static const char *norm(const char *kind, const char **text, char **owned)
{
    *owned = NULL;
    if (!strcmp(kind, "json_object")) {
        *text = "{\"type\": \"object\", \"x-guidance\": {\"whitespace_flexible\": false}}";
        return "json_schema";
    }
    if (!strcmp(kind, "json_schema")) {
        json_t *j = json_loads(*text, JSON_DECODE_ANY, NULL);
        if (json_is_object(j) && !json_object_get(j, "x-guidance")) {
            json_object_set_new(j, "x-guidance", json_pack("{s:b}", "whitespace_flexible", 0));
            if ((*owned = json_dumps(j, JSON_COMPACT)))
                *text = *owned;
        }
        json_decref(j);
    }
    return kind;
}

/* The engine's message on one line (newlines and runs of blanks become one space), at most
 * 400 bytes, without a trailing period. */
static int bad(struct err_buf *err, const char *m)
{
    char line[404];
    size_t n = 0;

    for (m = m && *m ? m : "invalid"; *m && n < 400; m++) {
        char c = *m == '\n' || *m == '\t' || *m == '\r' ? ' ' : *m;
        if (c == ' ' && (n == 0 || line[n - 1] == ' '))
            continue;
        line[n++] = c;
    }
    while (n > 0 && (line[n - 1] == '.' || line[n - 1] == ' '))
        n--;
    line[n] = 0;
    return err_set(err, -EINVAL, "%s", line);
}

int grammar_check(const struct grammar_vocab *v, const char *kind, const char *text,
                  struct err_buf *err)
{
    struct llg_init in;
    char msg[1024] = "";

    if (strlen(text) > GRAMMAR_MAX_TEXT)
        return err_set(err, -EINVAL, "longer than %u bytes", GRAMMAR_MAX_TEXT);
    char *owned;
    init_of(v, &in);
    kind = norm(kind, &text, &owned);
    int r = llg.validate(&in, kind, text, msg, sizeof(msg));
    free(owned);
    return r < 0 ? bad(err, msg) : 0;
}

struct grammar_matcher {
    void *m;
    int n_vocab;
    int32_t start_after;
    bool active;
    bool mask_ok;
    int n_acc;          /* tokens accepted since creation */
    int active_at;      /* n_acc when the matcher became active */
    size_t llg_bytes;   /* the library's mask size */
    uint32_t *llg_mask; /* the library's mask (NULL when it is n_vocab bits already) */
    uint32_t *mask;
    int pend;           /* prefetch: 0 none, 1 queued, 2 computing (under pool.lock) */
    struct grammar_matcher *q_next;
};

/* Prefetch: one thread computes queued matchers' masks while the caller runs the forward.
 * A matcher is only touched by the pool while pend == 2; every other call first takes it
 * back (sync), so the library never sees one matcher from two threads. */
static struct {
    pthread_mutex_t lock;
    pthread_cond_t cond;            /* queue non-empty, or a computation ended */
    struct grammar_matcher *head, *tail;
    bool started;
} pool = { PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, NULL, false };

static void compute_mask(struct grammar_matcher *g);

static void *pool_main(void *arg)
{
    (void) arg;
    pthread_mutex_lock(&pool.lock);
    for (;;) {
        while (!pool.head)
            pthread_cond_wait(&pool.cond, &pool.lock);
        struct grammar_matcher *g = pool.head;
        pool.head = g->q_next;
        if (!pool.head)
            pool.tail = NULL;
        g->pend = 2;
        pthread_mutex_unlock(&pool.lock);
        compute_mask(g);
        pthread_mutex_lock(&pool.lock);
        g->pend = 0;
        pthread_cond_broadcast(&pool.cond);
    }
    return NULL;
}

/* Take g back from the pool: dequeued if waiting, waited for if being computed. */
static void sync_g(struct grammar_matcher *g)
{
    if (!pool.started)
        return;
    pthread_mutex_lock(&pool.lock);
    if (g->pend == 1) {
        struct grammar_matcher **pp = &pool.head, *prev = NULL;
        while (*pp != g) {
            prev = *pp;
            pp = &(*pp)->q_next;
        }
        *pp = g->q_next;
        if (pool.tail == g)
            pool.tail = prev;
        g->pend = 0;
    }
    while (g->pend == 2)
        pthread_cond_wait(&pool.cond, &pool.lock);
    pthread_mutex_unlock(&pool.lock);
}

void grammar_matcher_prefetch(struct grammar_matcher *g)
{
    if (!g || !g->active)
        return;
    pthread_mutex_lock(&pool.lock);
    if (g->mask_ok || g->pend) {
        pthread_mutex_unlock(&pool.lock);
        return;
    }
    if (!pool.started) {
        pthread_t t;
        pthread_attr_t a;
        pthread_attr_init(&a);
        pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
        pool.started = pthread_create(&t, &a, pool_main, NULL) == 0;
        pthread_attr_destroy(&a);
        if (!pool.started) {            /* computed at the draw instead */
            pthread_mutex_unlock(&pool.lock);
            return;
        }
    }
    g->pend = 1;
    g->q_next = NULL;
    if (pool.tail)
        pool.tail->q_next = g;
    else
        pool.head = g;
    pool.tail = g;
    pthread_cond_signal(&pool.cond);
    pthread_mutex_unlock(&pool.lock);
}

int grammar_matcher_new(const struct grammar_vocab *v, const char *kind, const char *text,
                        int32_t start_after, struct grammar_matcher **ret, struct err_buf *err)
{
    struct llg_init in;
    struct grammar_matcher *g = calloc(1, sizeof(*g));

    if (!g)
        return err_set(err, -ENOMEM, "out of memory");
    if (strlen(text) > GRAMMAR_MAX_TEXT) {
        free(g);
        return err_set(err, -EINVAL, "longer than %u bytes", GRAMMAR_MAX_TEXT);
    }
    char *owned;
    init_of(v, &in);
    kind = norm(kind, &text, &owned);
    g->m = llg.new_matcher(&in, kind, text);
    free(owned);
    if (!g->m || llg.matcher_error(g->m)) {
        int r = bad(err, g->m ? llg.matcher_error(g->m) : "out of memory");
        grammar_matcher_free(g);
        return r;
    }
    g->n_vocab = v->n_vocab;
    g->start_after = start_after;
    g->active = start_after < 0;
    g->llg_bytes = llg.mask_bytes(g->m);
    size_t words = grammar_mask_words(v->n_vocab);
    g->mask = calloc(words, sizeof(uint32_t));
    if (g->llg_bytes != words * sizeof(uint32_t))
        g->llg_mask = calloc(1, g->llg_bytes);
    if (!g->mask || (g->llg_bytes != words * sizeof(uint32_t) && !g->llg_mask)) {
        grammar_matcher_free(g);
        return err_set(err, -ENOMEM, "out of memory");
    }
    *ret = g;
    return 0;
}

void grammar_matcher_free(struct grammar_matcher *g)
{
    if (!g)
        return;
    sync_g(g);
    if (g->m)
        llg.free_matcher(g->m);
    free(g->llg_mask);
    free(g->mask);
    free(g);
}

const uint32_t *grammar_matcher_mask(struct grammar_matcher *g)
{
    if (!g->active)
        return NULL;
    sync_g(g);
    if (!g->mask_ok)
        compute_mask(g);
    return g->mask;
}

static void compute_mask(struct grammar_matcher *g)
{
    size_t words = grammar_mask_words(g->n_vocab);
    if (!g->llg_mask) {
        if (llg.mask_into(g->m, g->mask, g->llg_bytes) < 0)
            memset(g->mask, 0, words * sizeof(uint32_t));
    } else {
        size_t n = g->llg_bytes < words * sizeof(uint32_t) ? g->llg_bytes : words * sizeof(uint32_t);
        memset(g->mask, 0, words * sizeof(uint32_t));
        if (llg.mask_into(g->m, g->llg_mask, g->llg_bytes) == 0)
            memcpy(g->mask, g->llg_mask, n);
        if (g->n_vocab % 32 && n == words * sizeof(uint32_t))
            g->mask[words - 1] &= (1u << (g->n_vocab % 32)) - 1;
    }
    g->mask_ok = true;
}

int grammar_matcher_accept(struct grammar_matcher *g, int32_t tok)
{
    sync_g(g);
    if (tok < 0 || tok >= g->n_vocab)
        return -EINVAL;
    if (!g->active) {
        g->n_acc++;
        if (tok == g->start_after) {
            g->active = true;
            g->active_at = g->n_acc;
            g->mask_ok = false;
        }
        return 0;
    }
    /* nothing follows the end (a token after it would put the matcher in its error state,
     * which no rollback leaves) */
    const uint32_t *m = grammar_matcher_mask(g);
    if (llg.is_stopped(g->m) || !grammar_mask_has(m, tok) || llg.consume(g->m, (uint32_t) tok) < 0)
        return -EINVAL;
    g->n_acc++;
    g->mask_ok = false;
    return 0;
}

int grammar_matcher_rollback(struct grammar_matcher *g, int n)
{
    sync_g(g);
    if (n < 0 || n > g->n_acc)
        return -EINVAL;
    if (n == 0)
        return 0;
    if (g->active) {
        int in_llg = g->n_acc - g->active_at;
        int k = n < in_llg ? n : in_llg;
        if (k > 0 && llg.rollback(g->m, (size_t) k) < 0)
            return -EINVAL;
        if (n > in_llg)
            g->active = g->start_after < 0;
    }
    g->n_acc -= n;
    g->mask_ok = false;
    return 0;
}
