/* bench-grammar.c - structured output at the real vocabulary size (issue 39): the time to
 * compute one token mask with llguidance (common/grammar.h) over a 128,896-token vocabulary,
 * the compile time of a small and a large JSON schema, the vocabulary build, and the sampler's
 * cost of applying the mask (greedy and sampled draws of one row, masked against free).
 *
 * The vocabulary: a real byte-level BPE tokenizer.json (argument 1; the build passes the one
 * the anthropic package ships, 65,000 ids) grown to VOCAB ids by adding the concatenation of
 * pairs of its tokens (deterministic picks), written to a temporary file for the run.  Masks
 * are timed along random walks through each constraint (tokens drawn among those allowed).
 *
 * Usage: bench-grammar TOKENIZER_JSON [VOCAB (128896)] [WALKS (8)]
 */
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "benchlib.h"
#include "grammar.h"
#include "sampler.h"

#define MAX_STEPS 160
#define MAX_SAMPLES (64 * MAX_STEPS)

static uint64_t rng = 0x9E3779B97F4A7C15ull;

static uint32_t rnd(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t) (rng >> 16);
}

/* The tokenizer grown to n ids, in a temporary file (path into out). */
static int grow(const char *src, int n, char *out, size_t outlen, int *eos)
{
    json_error_t je;
    json_t *t = json_load_file(src, 0, &je);
    if (!t) {
        fprintf(stderr, "%s: %s\n", src, je.text);
        return -EINVAL;
    }
    json_t *vocab = json_object_get(json_object_get(t, "model"), "vocab");
    json_t *added = json_object_get(t, "added_tokens");
    size_t nv = json_object_size(vocab), na = json_array_size(added);
    const char **keys = malloc(nv * sizeof(*keys));
    const char *k;
    json_t *v;
    size_t i = 0, next = 0;

    json_object_foreach(vocab, k, v) {
        keys[i++] = k;
        if ((size_t) json_integer_value(v) >= next)
            next = (size_t) json_integer_value(v) + 1;
    }
    for (i = 0; i < na; i++) {
        size_t id = (size_t) json_integer_value(json_object_get(json_array_get(added, i), "id"));
        if (id >= next)
            next = id + 1;
    }
    *eos = na ? (int) json_integer_value(json_object_get(json_array_get(added, 0), "id")) : 0;
    char buf[1200];
    while (next < (size_t) n) {
        const char *a = keys[rnd() % nv], *b = keys[rnd() % nv];
        if (strlen(a) + strlen(b) >= 512)
            continue;
        snprintf(buf, sizeof(buf), "%s%s", a, b);
        if (json_object_get(vocab, buf))
            continue;
        json_object_set_new(vocab, buf, json_integer((json_int_t) next++));
    }
    free(keys);
    snprintf(out, outlen, "/tmp/bench-grammar-XXXXXX");
    int fd = mkstemp(out);
    if (fd < 0)
        return -errno;
    close(fd);
    int r = json_dump_file(t, out, JSON_COMPACT);
    json_decref(t);
    return r < 0 ? -EIO : 0;
}

static int allowed_count(const uint32_t *m, int n)
{
    int c = 0;
    for (int w = 0; w < (n + 31) / 32; w++)
        c += __builtin_popcount(m[w]);
    return c;
}

/* Random walks through kind/text: every mask computed is one sample (ms) into ms[]. */
static int walk(const struct grammar_vocab *gv, int n_vocab, int eos, const char *kind,
                const char *text, int walks, double *ms, double *compile_ms)
{
    struct err_buf eb;
    int ns = 0;
    double comp[64];

    for (int w = 0; w < walks; w++) {
        struct grammar_matcher *m;
        double t0 = bench_now();
        if (grammar_matcher_new(gv, kind, text, -1, &m, &eb) < 0) {
            fprintf(stderr, "%s: %s\n", kind, eb.msg);
            exit(1);
        }
        comp[w] = (bench_now() - t0) * 1e3;
        for (int s = 0; s < MAX_STEPS; s++) {
            t0 = bench_now();
            const uint32_t *mask = grammar_matcher_mask(m);
            ms[ns++] = (bench_now() - t0) * 1e3;
            int c = allowed_count(mask, n_vocab);
            if (c == 0 || (grammar_mask_has(mask, eos) && (c == 1 || rnd() % 4 == 0)))
                break;
            int pick = (int) (rnd() % (uint32_t) c), t;
            for (t = 0; t < n_vocab; t++)
                if (grammar_mask_has(mask, t) && pick-- == 0)
                    break;
            if (t == eos || grammar_matcher_accept(m, t) < 0)
                break;
        }
        grammar_matcher_free(m);
    }
    *compile_ms = bench_median(comp, walks);
    return ns;
}

static void report(const char *what, double *ms, int n, double compile_ms)
{
    double med = bench_median(ms, n);
    printf("%-34s masks %5d  median %7.3f ms  p90 %7.3f ms  max %7.3f ms  compile %8.2f ms\n", what, n,
           med, ms[(int) (n * 0.9)], ms[n - 1], compile_ms);
}

/* A large schema: n properties, each an object with an enum, a bounded integer, a string and
 * an array. */
static char *large_schema(int n)
{
    json_t *props = json_object(), *req = json_array();
    for (int i = 0; i < n; i++) {
        char name[32];
        snprintf(name, sizeof(name), "field_%d", i);
        json_object_set_new(props, name, json_pack(
            "{s:s, s:{s:{s:[s,s,s]}, s:{s:s, s:i, s:i}, s:{s:s, s:i}, s:{s:s, s:{s:s}, s:i}}, s:[s,s]}",
            "type", "object", "properties",
            "kind", "enum", "a", "b", "c",
            "count", "type", "integer", "minimum", 0, "maximum", 1000,
            "label", "type", "string", "maxLength", 20,
            "list", "type", "array", "items", "type", "boolean", "maxItems", 4,
            "required", "kind", "count"));
        json_array_append_new(req, json_string(name));
    }
    json_t *s = json_pack("{s:s, s:o, s:o, s:b}", "type", "object", "properties", props, "required", req,
                          "additionalProperties", 0);
    char *text = json_dumps(s, JSON_COMPACT);
    json_decref(s);
    return text;
}

int main(int argc, char **argv)
{
    char path[64];
    struct err_buf eb;
    struct grammar_vocab *gv;
    int n_vocab = argc > 2 ? atoi(argv[2]) : 128896, walks = argc > 3 ? atoi(argv[3]) : 8, eos;
    static double ms[MAX_SAMPLES];

    if (argc < 2 || walks < 1 || walks > 64) {
        fprintf(stderr, "usage: bench-grammar TOKENIZER_JSON [VOCAB] [WALKS 1..64]\n");
        return 2;
    }
    if (grammar_lib_open(&eb) < 0) {
        fprintf(stderr, "%s\n", eb.msg);
        return 77;
    }
    if (grow(argv[1], n_vocab, path, sizeof(path), &eos) < 0)
        return 1;
    double t0 = bench_now();
    int32_t e = eos;
    int r = grammar_vocab_new(path, n_vocab, &e, 1, &gv, &eb);
    unlink(path);
    if (r < 0) {
        fprintf(stderr, "%s\n", eb.msg);
        return 1;
    }
    printf("grammar vocabulary: %d ids (grown from %s), built in %.1f ms\n", n_vocab, argv[1],
           (bench_now() - t0) * 1e3);

    static const char *schema = "{\"type\":\"object\",\"properties\":{"
        "\"name\":{\"type\":\"string\",\"maxLength\":24},"
        "\"age\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":120},"
        "\"role\":{\"enum\":[\"admin\",\"user\",\"guest\"]},"
        "\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\",\"maxLength\":8},\"maxItems\":4},"
        "\"address\":{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"},"
        "\"zip\":{\"type\":\"string\",\"pattern\":\"^[0-9]{5}$\"}},\"required\":[\"city\",\"zip\"]}},"
        "\"required\":[\"name\",\"age\",\"role\",\"address\"]}";
    double comp;
    int n = walk(gv, n_vocab, eos, "json_schema", schema, walks, ms, &comp);
    report("json_schema (nested, 5 properties)", ms, n, comp);
    n = walk(gv, n_vocab, eos, "json_object", "", walks, ms, &comp);
    report("json_object", ms, n, comp);
    n = walk(gv, n_vocab, eos, "regex", "[A-Z][a-z]{2,12}( [A-Z][a-z]{2,12}){0,3}, [0-9]{1,5}", walks, ms, &comp);
    report("regex", ms, n, comp);
    n = walk(gv, n_vocab, eos, "lark", "start: item (\", \" item)*\nitem: /[a-z]+/ | NUMBER\nNUMBER: /[0-9]+/",
             walks, ms, &comp);
    report("lark", ms, n, comp);
    char *big = large_schema(200);
    n = walk(gv, n_vocab, eos, "json_schema", big, 2, ms, &comp);
    report("json_schema (200 object properties)", ms, n, comp);
    printf("  (large schema: %zu bytes)\n", strlen(big));
    free(big);

    /* the sampler: one row drawn free vs under a mask allowing ~1% of the ids */
    struct sampler *smp;
    struct sampling_params sp;
    float *row = malloc((size_t) n_vocab * sizeof(float));
    uint32_t *mask = calloc(grammar_mask_words(n_vocab), sizeof(uint32_t));
    double free_ms[200], mask_ms[200];
    if (sampler_new(n_vocab, &smp) < 0)
        return 1;
    for (int i = 0; i < n_vocab; i++) {
        row[i] = (float) (rnd() % 10000) * 1e-3f;
        if (rnd() % 100 == 0)
            mask[i / 32] |= 1u << (i % 32);
    }
    for (int greedy = 1; greedy >= 0; greedy--) {
        sampling_params_init(&sp);
        sp.temperature = greedy ? 0.0f : 0.8f;
        sp.top_p = greedy ? 1.0f : 0.95f;
        for (int i = 0; i < 200; i++) {
            sp.allow = NULL;
            t0 = bench_now();
            (void) sampler_sample(smp, &sp, NULL, row, (uint64_t) i, 0);
            free_ms[i] = (bench_now() - t0) * 1e3;
            sp.allow = mask;
            t0 = bench_now();
            (void) sampler_sample(smp, &sp, NULL, row, (uint64_t) i, 0);
            mask_ms[i] = (bench_now() - t0) * 1e3;
        }
        double f = bench_median(free_ms, 200), m = bench_median(mask_ms, 200);
        printf("sampler %-7s one row: free %.3f ms, masked %.3f ms (x%.2f)\n", greedy ? "greedy" : "sampled",
               f, m, m / f);
    }
    sampler_free(smp);
    free(row);
    free(mask);
    grammar_vocab_free(gv);
    return 0;
}
