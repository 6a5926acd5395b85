/* safetensors.h - a hostile-input safetensors reader (docs/MODEL.md §8, docs/RELIABILITY.md C1-C4).
 *
 * File format (huggingface/safetensors):
 *   bytes 0..7         u64 little-endian N = header length
 *   bytes 8..8+N-1     UTF-8 JSON object, padded with trailing spaces:
 *                      { "__metadata__": {str: str, ...},            (optional)
 *                        "<name>": {"dtype": "BF16", "shape": [d0, ...],
 *                                   "data_offsets": [begin, end]}, ... }
 *   bytes 8+N..EOF     data buffer; offsets are relative to its start, row-major,
 *                      little-endian, no alignment guaranteed.
 *
 * Checks (each failure names the file and, where there is one, the tensor):
 *   - file >= 8 bytes; 8 + N does not overflow; 0 < N <= SFT_HEADER_MAX; 8 + N <= file size
 *     (all before any allocation sized by N);
 *   - header is valid UTF-8 without NUL bytes, starts with '{', may end in whitespace,
 *     nests at most SFT_DEPTH_MAX deep, holds at most SFT_TENSORS_MAX keys (pre-scan
 *     before the JSON parser allocates anything);
 *   - strict JSON: duplicate keys rejected;
 *   - "__metadata__" maps strings to strings (at most SFT_METADATA_MAX entries);
 *   - each tensor: name 1..SFT_NAME_MAX printable ASCII bytes without '/', '\\' or "..";
 *     exactly the keys dtype/shape/data_offsets; dtype from the safetensors list;
 *     shape of at most TENSOR_MAX_DIMS non-negative integers; data_offsets two
 *     non-negative integers with begin <= end; numel and numel x bits computed with
 *     overflow checks; sub-byte dtypes end on a byte boundary; end - begin equals the size;
 *   - sorted by offset the tensors tile the buffer exactly: first begins at 0, each
 *     begins where the previous ended, and the last end equals file size - 8 - N
 *     (no missing data, no trailing bytes: polyglot files are refused).
 *
 * mmap policy (C4): the size check above happens before mmap; files are opened
 * O_RDONLY|O_CLOEXEC and mapped PROT_READ, MAP_PRIVATE.  SIGBUS policy: the model
 * directory must not change while a process has it open.  A shard truncated after
 * mapping makes the next access to the lost pages raise SIGBUS; the reader does not
 * catch it, so the process dies (a worker is restarted by systemd/Kubernetes and
 * reloads the now-checked files).  Workers copy weights to the device during load,
 * which bounds the window.  test-safetensors checks this outcome in a forked child.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "err.h"
#include "tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

#define SFT_HEADER_MAX 100000000ull   /* bytes, as the reference reader */
#define SFT_TENSORS_MAX 262144        /* keys in one header (the full model has 73 921) */
#define SFT_METADATA_MAX 4096         /* __metadata__ entries */
#define SFT_NAME_MAX 512              /* bytes in a tensor name */
#define SFT_DEPTH_MAX 4               /* header JSON nesting (3 is enough) */
#define SFT_INDEX_MAX (256u << 20)    /* bytes of model.safetensors.index.json */

struct sft_tensor {
    char *name;                       /* owned by the header */
    enum dtype dtype;
    int ndim;
    int64_t shape[TENSOR_MAX_DIMS];
    uint64_t begin, end;              /* byte offsets in the data buffer */
};

struct sft_header {
    struct sft_tensor *tensors;       /* sorted by name */
    size_t n_tensors;
    uint64_t header_len;              /* N */
    uint64_t data_len;                /* bytes of the data buffer */
    size_t n_metadata;
};

/* Parse the JSON header text (len bytes, no length prefix).  data_len receives
 * the end of the last tensor.  fname is used in messages. */
int sft_header_parse(const char *text, size_t len, const char *fname, struct sft_header *ret,
                     struct err_buf *e);
void sft_header_done(struct sft_header *h);
/* Binary search by name; NULL if absent. */
const struct sft_tensor *sft_header_find(const struct sft_header *h, const char *name);

/* Validate a whole file image in memory (length prefix, header, exact size). */
int sft_parse_mem(const void *buf, size_t size, const char *fname, struct sft_header *ret,
                  struct err_buf *e);

enum sft_open_flags {
    SFT_OPEN_HEADERS_ONLY = 1 << 0,   /* validate, do not map the data */
};

struct sft_file;

/* Open, validate and (unless headers-only) mmap one shard.  The file object owns
 * the mapping; views from sft_file_view() borrow from it until sft_close(). */
int sft_open(const char *path, int flags, struct sft_file **ret, struct err_buf *e);
void sft_close(struct sft_file *f);
const struct sft_header *sft_file_header(const struct sft_file *f);
const char *sft_file_path(const struct sft_file *f);
/* View of tensor t of f (t from sft_file_header(f)); data is NULL when headers-only. */
void sft_file_view(const struct sft_file *f, const struct sft_tensor *t, struct tview *ret);

/* model.safetensors.index.json: {"metadata": {...}, "weight_map": {name: shard}}.
 * metadata (total_size) is never trusted; shard names must be plain file names
 * (no '/', '\\', NUL, not "." or "..", at most 255 bytes, ending ".safetensors"). */
struct sft_index {
    char **names;                     /* tensor names, sorted */
    int *shard_of;                    /* names[i] lives in shards[shard_of[i]] */
    size_t n;
    char **shards;                    /* distinct shard file names, sorted */
    size_t n_shards;
};

int sft_index_parse(const char *text, size_t len, const char *fname, struct sft_index *ret,
                    struct err_buf *e);
void sft_index_done(struct sft_index *idx);
/* Index in names[] or -1. */
long sft_index_find(const struct sft_index *idx, const char *name);

#ifdef __cplusplus
}
#endif
