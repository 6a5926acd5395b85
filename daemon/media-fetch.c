/* media-fetch.c - a request's images fetched (http(s) URLs of allowed domains, with libcurl)
 * and decoded and preprocessed on libuv's threadpool; see media.h ("Off the loop").  The
 * decoding helpers media.c's parse shares (media_image_prepare, media_base64_decode, ...)
 * live here, so that media.c calls this file and never the other way round. */
#include "media.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include <curl/curl.h>
#include <gnutls/gnutls.h>

#include "clock.h"
#include "err.h"
#include "log.h"
#include "stepd-config.h"
#include "stepd.pb-c.h"
#include "strbuf.h"
#include "tokenizer.h"

#define MAX_REDIRECTS 5

/* one image_url part (a data URL, or an http(s) URL of an allowed host), in the order of the
 * parts; the worker thread's until done */
struct fetch_item {
    size_t msg, part;               /* messages[msg].content[part] */
    char *url;                      /* an http(s) URL, or NULL */
    char *b64;                      /* a data URL's base64 payload, or NULL */
    const void *bytes;              /* else the encoded image (the gRPC call's, alive until done) */
    size_t n_bytes;
    struct strbuf body;             /* a URL's bytes */
    struct image_prep prep;         /* decoded and preprocessed (prepped), moved out by media_taken */
    bool prepped;
    int rc;                         /* 0 or the failure's error (-ENOMEM: out of memory) */
    char err[320];                  /* "" or why it failed (no part name) */
    bool done;                      /* prepared or failed (not: skipped after an earlier failure) */
};

struct media_fetch {
    uv_work_t work;
    struct fetch_item *items;
    size_t n_items;
    atomic_bool cancelled;
    /* read by the worker: copied from media_conf (and the tokenizer) when the job starts */
    struct image_limits lim;
    struct image_token_ids ids;
    bool have_ids;                  /* the image tokens are known: prepared, else only decoded */
    size_t max_bytes;
    unsigned timeout_ms;
    char **domains;
    size_t n_domains;
    media_fetch_fn done;
    void *ud;
};

static bool curl_ready;
static unsigned n_running;          /* jobs queued or running (loop thread) */

bool media_url_host_allowed(const char *url, char *host, size_t len)
{
    return media_url_host_in(url, (const char *const *)media_conf.allowed_domains, media_conf.n_allowed_domains,
                             host, len);
}

bool media_url_host_in(const char *url, const char *const *domains, size_t n_domains, char *host, size_t len)
{
    CURLU *u = curl_url();
    char *h = NULL, *scheme = NULL;
    bool ok = false;

    if (len)
        host[0] = 0;
    if (!u)
        return false;
    /* CURLU_NON_SUPPORT_SCHEME: parse any scheme, so that the check below names it */
    if (curl_url_set(u, CURLUPART_URL, url, CURLU_NON_SUPPORT_SCHEME) == CURLUE_OK &&
        curl_url_get(u, CURLUPART_SCHEME, &scheme, 0) == CURLUE_OK &&
        curl_url_get(u, CURLUPART_HOST, &h, 0) == CURLUE_OK) {
        if (len)
            snprintf(host, len, "%s", h);
        if (!strcasecmp(scheme, "http") || !strcasecmp(scheme, "https"))
            for (size_t i = 0; i < n_domains && !ok; i++)
                ok = !strcasecmp(domains[i], h);
    }
    curl_free(h);
    curl_free(scheme);
    curl_url_cleanup(u);
    return ok;
}

/* ------------------------------------------------------------------ any thread */

int media_token_ids(const struct tokenizer *tok, struct image_token_ids *ret, char *msg, size_t len)
{
    static const char *const names[] = { "<im_start>", "<im_end>", "<patch_start>", "<patch_end>",
                                         "<patch_newline>", "<im_patch>" };
    int32_t *out[] = { &ret->im_start, &ret->im_end, &ret->patch_start, &ret->patch_end, &ret->patch_newline,
                       &ret->im_patch };

    for (size_t i = 0; i < ARRAY_SIZE(names); i++) {
        int32_t id = tok ? tok_token_to_id(tok, names[i]) : -ENOENT;
        if (id < 0) {
            snprintf(msg, len, "the model has no vision tower (%s)",
                     tok ? "its tokenizer has no image tokens" : "no tokenizer is loaded");
            return -ENOENT;
        }
        *out[i] = id;
    }
    return 0;
}

const char *media_data_url_payload_at(const char *url, const char *at, char *msg, size_t len)
{
    const char *comma = strchr(url, ','), *semi;
    size_t n_meta;

    if (!comma) {
        snprintf(msg, len, "%s: a data URL must be data:image/<type>;base64,<data>", at);
        return NULL;
    }
    n_meta = comma - (url + 5);
    if (n_meta < 6 || strncasecmp(url + 5, "image/", 6)) {
        snprintf(msg, len, "%s: the data URL's media type must be image/... (got '%.*s')", at,
                 (int)(n_meta > 40 ? 40 : n_meta), url + 5);
        return NULL;
    }
    semi = memchr(url + 5, ';', n_meta);
    if (!semi || (size_t)(comma - semi) != 7 || strncasecmp(semi, ";base64", 7)) {
        snprintf(msg, len, "%s: only base64 data URLs are supported (data:image/<type>;base64,<data>)", at);
        return NULL;
    }
    size_t n64 = strlen(comma + 1);
    if (n64 / 4 * 3 > media_conf.lim.max_bytes + 3) {
        snprintf(msg, len, "%s: the image has about %zu bytes, more than the limit of %zu (--image-max-bytes)", at,
                 n64 / 4 * 3, media_conf.lim.max_bytes);
        return NULL;
    }
    return comma + 1;
}

const char *media_data_url_payload(const char *url)
{
    char msg[8];

    return strncasecmp(url, "data:", 5) ? NULL : media_data_url_payload_at(url, "", msg, sizeof(msg));
}

int media_base64_decode(const char *p, void **ret, size_t *n, char *err, size_t len)
{
    gnutls_datum_t in = { (unsigned char *)p, (unsigned)strlen(p) }, out = { NULL, 0 };
    int g = gnutls_base64_decode2(&in, &out);

    if (g == GNUTLS_E_MEMORY_ERROR)
        return -ENOMEM;
    if (g < 0) {
        snprintf(err, len, "the data URL's base64 does not decode (%s)", gnutls_strerror(g));
        return -EINVAL;
    }
    *ret = out.data;
    *n = out.size;
    return 0;
}

/* The test-only decode gate (media.h: MEDIA_TEST_DECODE_GATE_ENV): a FIFO each decode reads
 * one byte from first, blocking until the test writes it.  Its path is read from the
 * environment once per process, at the first decode (whichever threadpool thread runs it):
 * later decodes read no environment, and a variable set after that has no effect. */
static pthread_once_t gate_once = PTHREAD_ONCE_INIT;
static char *gate_path;         /* NULL: no gate (the variable unset or empty) */

static void gate_resolve(void)
{
    const char *path = getenv(MEDIA_TEST_DECODE_GATE_ENV);

    if (path && path[0] && !(gate_path = strdup(path)))
        log_warn("out of memory keeping %s: no decode gate", MEDIA_TEST_DECODE_GATE_ENV);
}

static void decode_gate(void)
{
    char c;
    int fd;

    pthread_once(&gate_once, gate_resolve);
    if (!gate_path || (fd = open(gate_path, O_RDONLY | O_CLOEXEC)) < 0)
        return;
    while (read(fd, &c, 1) < 0 && errno == EINTR)
        ;
    close(fd);
}

int media_image_prepare(const void *data, size_t n, const struct image_limits *lim,
                        const struct image_token_ids *ids, struct image_prep *ret, bool *prepped, struct err_buf *e)
{
    struct image img;
    int r;

    *prepped = false;
    decode_gate();
    if ((r = image_decode(data, n, lim, &img, e)) < 0)
        return r;
    if (ids && (r = image_prep(&img, ids, ret, e)) == 0)
        *prepped = true;
    image_done(&img);
    return r;
}

/* ------------------------------------------------------------------ the worker thread */

struct xfer {
    struct media_fetch *f;
    struct fetch_item *it;
    bool too_large;
};

static size_t on_body(char *p, size_t size, size_t n, void *ud)
{
    struct xfer *x = ud;

    n *= size;              /* size is 1 */
    if (x->it->body.len + n > x->f->max_bytes) {
        x->too_large = true;
        return 0;           /* CURLE_WRITE_ERROR: the transfer stops here */
    }
    return strbuf_add(&x->it->body, p, n) < 0 ? 0 : n;
}

static int on_progress(void *ud, curl_off_t dlt, curl_off_t dln, curl_off_t ult, curl_off_t uln)
{
    struct xfer *x = ud;

    (void)dlt, (void)dln, (void)ult, (void)uln;
    return atomic_load(&x->f->cancelled);      /* the client went away: CURLE_ABORTED_BY_CALLBACK */
}

static void fetch_one(struct media_fetch *f, struct fetch_item *it)
{
    int64_t start = clk_now_ms();
    char *url = strdup(it->url), host[256];
    CURL *c = curl_easy_init();
    struct xfer x = { f, it, false };

    if (!url || !c) {
        snprintf(it->err, sizeof(it->err), "out of memory fetching the image URL");
        goto out;
    }
    for (int hop = 0;; hop++) {
        int64_t spent = clk_now_ms() - start;
        long status = 0;
        char *next = NULL;
        CURLcode cr;

        if (spent >= (int64_t)f->timeout_ms) {
            cr = CURLE_OPERATION_TIMEDOUT;
        } else {
            strbuf_reset(&it->body);
            x.too_large = false;
            curl_easy_reset(c);
            curl_easy_setopt(c, CURLOPT_URL, url);
            curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http,https");
            curl_easy_setopt(c, CURLOPT_FOLLOWLOCATION, 0L);    /* each redirect checked below */
            curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
            curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, (long)(f->timeout_ms - spent));
            curl_easy_setopt(c, CURLOPT_MAXFILESIZE_LARGE, (curl_off_t)f->max_bytes);
            curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
            curl_easy_setopt(c, CURLOPT_WRITEDATA, &x);
            curl_easy_setopt(c, CURLOPT_NOPROGRESS, 0L);
            curl_easy_setopt(c, CURLOPT_XFERINFOFUNCTION, on_progress);
            curl_easy_setopt(c, CURLOPT_XFERINFODATA, &x);
            curl_easy_setopt(c, CURLOPT_USERAGENT, "stepd/" STEPD_VERSION);
            cr = curl_easy_perform(c);
        }
        switch (cr) {
        case CURLE_OK:
            break;
        case CURLE_FILESIZE_EXCEEDED:
            x.too_large = true;
            /* fall through */
        case CURLE_WRITE_ERROR:
            if (x.too_large)
                snprintf(it->err, sizeof(it->err), "the image URL's body is larger than the limit of %zu bytes "
                         "(--image-max-bytes)", f->max_bytes);
            else
                snprintf(it->err, sizeof(it->err), "out of memory fetching the image URL");
            goto out;
        case CURLE_OPERATION_TIMEDOUT:
            snprintf(it->err, sizeof(it->err), "fetching the image URL timed out after %.3g s "
                     "(--media-fetch-timeout)", f->timeout_ms / 1000.0);
            goto out;
        case CURLE_COULDNT_RESOLVE_HOST:
        case CURLE_COULDNT_CONNECT:
            snprintf(it->err, sizeof(it->err), "could not connect to the image URL's host (%s)",
                     curl_easy_strerror(cr));
            goto out;
        case CURLE_ABORTED_BY_CALLBACK:
            snprintf(it->err, sizeof(it->err), "the request was cancelled while its image was fetched");
            goto out;
        default:
            snprintf(it->err, sizeof(it->err), "fetching the image URL failed (%s)", curl_easy_strerror(cr));
            goto out;
        }
        curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
        if (status >= 200 && status < 300)
            break;
        if (status < 300 || status >= 400) {
            snprintf(it->err, sizeof(it->err), "the image URL answered HTTP status %ld", status);
            goto out;
        }
        curl_easy_getinfo(c, CURLINFO_REDIRECT_URL, &next);
        if (!next) {
            snprintf(it->err, sizeof(it->err), "the image URL answered HTTP status %ld without a Location", status);
            goto out;
        }
        if (!media_url_host_in(next, (const char *const *)f->domains, f->n_domains, host, sizeof(host))) {
            snprintf(it->err, sizeof(it->err), "the image URL redirects to '%.100s', which is not an http(s) URL "
                     "of an allowed domain (--allowed-media-domains)", host[0] ? host : next);
            goto out;
        }
        if (hop == MAX_REDIRECTS) {
            snprintf(it->err, sizeof(it->err), "the image URL redirects more than %d times", MAX_REDIRECTS);
            goto out;
        }
        free(url);
        if (!(url = strdup(next))) {
            snprintf(it->err, sizeof(it->err), "out of memory fetching the image URL");
            goto out;
        }
    }
    if (it->body.oom)
        snprintf(it->err, sizeof(it->err), "out of memory fetching the image URL");
out:
    if (it->err[0])
        strbuf_done(&it->body);
    it->done = true;
    curl_easy_cleanup(c);
    free(url);
}

/* it's bytes decoded and preprocessed into it->prep (it->err on failure) */
static void prepare_one(struct media_fetch *f, struct fetch_item *it, const void *data, size_t n)
{
    struct err_buf e = { "" };

    it->rc = media_image_prepare(data, n, &f->lim, f->have_ids ? &f->ids : NULL, &it->prep, &it->prepped, &e);
    if (it->rc == -ENOMEM)
        snprintf(it->err, sizeof(it->err), "out of memory decoding the image");
    else if (it->rc < 0)
        snprintf(it->err, sizeof(it->err), "%s", e.msg);
}

/* the parts one after another; the first failure ends the job (its part is the 400) */
static void work_cb(uv_work_t *w)
{
    struct media_fetch *f = w->data;

    for (size_t i = 0; i < f->n_items && !atomic_load(&f->cancelled); i++) {
        struct fetch_item *it = &f->items[i];

        if (it->url) {
            fetch_one(f, it);
            if (!it->err[0])
                prepare_one(f, it, it->body.p, it->body.len);
            strbuf_done(&it->body);
        } else if (!it->b64) {
            prepare_one(f, it, it->bytes, it->n_bytes);
            it->done = true;
        } else {
            void *bytes = NULL;
            size_t n = 0;

            if ((it->rc = media_base64_decode(it->b64, &bytes, &n, it->err, sizeof(it->err))) == 0)
                prepare_one(f, it, bytes, n);
            else if (it->rc == -ENOMEM)
                snprintf(it->err, sizeof(it->err), "out of memory decoding the image");
            gnutls_free(bytes);
            it->done = true;
        }
        if (it->err[0])
            break;
    }
}

static void after_cb(uv_work_t *w, int status)
{
    struct media_fetch *f = w->data;

    (void)status;
    n_running--;
    f->done(f, f->ud);
}

/* ------------------------------------------------------------------ the loop thread */

void media_fetch_free(struct media_fetch *f)
{
    if (!f)
        return;
    for (size_t i = 0; i < f->n_items; i++) {
        free(f->items[i].url);
        free(f->items[i].b64);
        strbuf_done(&f->items[i].body);
        if (f->items[i].prepped)
            image_prep_done(&f->items[i].prep);
    }
    for (size_t i = 0; i < f->n_domains; i++)
        free(f->domains[i]);
    free(f->domains);
    free(f->items);
    free(f);
}

void media_fetch_cancel(struct media_fetch *f)
{
    atomic_store(&f->cancelled, true);
}

/* one more item, messages[msg].content[part] (zeroed): NULL when out of memory */
static struct fetch_item *item_add(struct media_fetch *f, size_t msg, size_t part)
{
    struct fetch_item *p = realloc(f->items, sizeof(*p) * (f->n_items + 1));

    if (!p)
        return NULL;
    f->items = p;
    p += f->n_items++;
    memset(p, 0, sizeof(*p));
    p->msg = msg;
    p->part = part;
    p->body = (struct strbuf)STRBUF_INIT;
    return p;
}

/* the image_url parts media_chat_images would decode: those up to the image limit that are a
 * well-formed data URL or an http(s) URL of an allowed host (the others are refused by the
 * parse without any work) */
static int collect(struct media_fetch *f, const json_t *messages, bool *any_url)
{
    const json_t *m, *part, *c, *t, *iu, *u;
    size_t i, k, n = 0;

    json_array_foreach(messages, i, m) {
        if (!json_is_array(c = json_object_get(m, "content")))
            continue;
        json_array_foreach(c, k, part) {
            const char *url, *b64 = NULL;

            if (!json_is_object(part) || !json_is_string(t = json_object_get(part, "type")) ||
                strcmp(json_string_value(t), "image_url"))
                continue;
            if (++n > (size_t)media_conf.limit_image)
                return 0;
            if (!json_is_object(iu = json_object_get(part, "image_url")) ||
                !json_is_string(u = json_object_get(iu, "url")))
                continue;
            url = json_string_value(u);
            if (!(b64 = media_data_url_payload(url)) && !media_url_host_allowed(url, NULL, 0))
                continue;
            struct fetch_item *p = item_add(f, i, k);
            if (!p || !(b64 ? (p->b64 = strdup(b64)) : (p->url = strdup(url))))
                return -ENOMEM;
            *any_url |= !b64;
        }
    }
    return 0;
}

/* f's items (collected; none: nothing to do) worked on off the loop: media_fetch_start's */
static int job_start(uv_loop_t *loop, struct media_fetch *f, bool any_url, const struct tokenizer *tok,
                     media_fetch_fn done, void *ud, struct media_fetch **ret)
{
    char why[256];
    int r;

    if (f->n_items == 0) {
        media_fetch_free(f);
        return 0;
    }
    if (n_running >= MEDIA_MAX_JOBS) {
        media_fetch_free(f);
        return -EBUSY;
    }
    if (any_url && !curl_ready) {
        /* once, on the loop thread, before any worker uses libcurl */
        if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK) {
            media_fetch_free(f);
            return -ENOMEM;
        }
        curl_ready = true;
    }
    f->lim = media_conf.lim;
    f->have_ids = media_token_ids(tok, &f->ids, why, sizeof(why)) == 0;
    f->max_bytes = media_conf.lim.max_bytes;
    f->timeout_ms = media_conf.fetch_timeout_ms;
    if (media_conf.n_allowed_domains && !(f->domains = calloc(media_conf.n_allowed_domains, sizeof(char *)))) {
        media_fetch_free(f);
        return -ENOMEM;
    }
    for (; f->n_domains < media_conf.n_allowed_domains; f->n_domains++)
        if (!(f->domains[f->n_domains] = strdup(media_conf.allowed_domains[f->n_domains]))) {
            media_fetch_free(f);
            return -ENOMEM;
        }
    atomic_init(&f->cancelled, false);
    f->done = done;
    f->ud = ud;
    f->work.data = f;
    if ((r = uv_queue_work(loop, &f->work, work_cb, after_cb)) < 0) {
        log_warn("media: cannot queue an image job: %s", uv_strerror(r));
        media_fetch_free(f);
        return -ENOMEM;
    }
    n_running++;
    *ret = f;
    return 1;
}

int media_fetch_start(uv_loop_t *loop, const json_t *messages, const struct tokenizer *tok, media_fetch_fn done,
                      void *ud, struct media_fetch **ret)
{
    struct media_fetch *f;
    bool any_url = false;
    int r;

    *ret = NULL;
    if (!json_is_array(messages))
        return 0;
    if (!(f = calloc(1, sizeof(*f))))
        return -ENOMEM;
    if ((r = collect(f, messages, &any_url)) < 0) {
        media_fetch_free(f);
        return r;
    }
    return job_start(loop, f, any_url, tok, done, ud, ret);
}

int media_proto_start(uv_loop_t *loop, const Stepd__V1__GenerateRequest *pb, const struct tokenizer *tok,
                      media_fetch_fn done, void *ud, struct media_fetch **ret)
{
    struct media_fetch *f;

    *ret = NULL;
    if (pb->n_images == 0 || pb->input_case == STEPD__V1__GENERATE_REQUEST__INPUT_TOKEN_IDS)
        return 0;       /* refused by media_proto_images without any work */
    if (!(f = calloc(1, sizeof(*f))))
        return -ENOMEM;
    for (size_t i = 0; i < pb->n_images && i < (size_t)media_conf.limit_image; i++) {
        const Stepd__V1__ImageInput *im = pb->images[i];
        struct fetch_item *p;

        if (im->sha256.len || im->n_views || im->n_token_ids || im->token_position)
            break;      /* refused by the parse: the parts after it are not looked at */
        if (!(p = item_add(f, 0, i))) {
            media_fetch_free(f);
            return -ENOMEM;
        }
        p->bytes = im->data.data;
        p->n_bytes = im->data.len;
    }
    return job_start(loop, f, false, tok, done, ud, ret);
}

int media_taken(struct media_fetch *f, size_t msg, size_t part, struct image_prep *ret, bool *prepped,
                const char **err)
{
    for (size_t i = 0; f && i < f->n_items; i++) {
        struct fetch_item *it = &f->items[i];
        if (it->msg != msg || it->part != part)
            continue;
        if (!it->done)
            return -ENOENT;
        if (it->rc == -ENOMEM)
            return -ENOMEM;
        *err = it->err[0] ? it->err : NULL;
        *prepped = it->prepped;
        if (it->prepped)
            *ret = it->prep;
        it->prepped = false;        /* moved: taken once */
        return 0;
    }
    return -ENOENT;
}

void media_start_error(int r, char *msg, size_t len)
{
    if (r == -EBUSY)
        snprintf(msg, len, "too many requests' images are being decoded (%d at once); retry later", MEDIA_MAX_JOBS);
    else
        snprintf(msg, len, "out of memory");
}

unsigned media_jobs_running(void)
{
    return n_running;
}

void media_fetch_global_done(void)
{
    /* a fetch still running (the loop closed under it) keeps libcurl's state: the process ends */
    if (curl_ready && n_running == 0)
        curl_global_cleanup();
    curl_ready = false;
}
