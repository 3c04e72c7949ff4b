/*
 * dsec-helper conntrack: the connection-tracking entries of this edge's
 * sandboxes, for its network layer (ADR 0005, "Flows"). The firewall marks
 * every flow it admits from a sandbox with that sandbox's conntrack mark, and
 * lets later packets of a flow through only while its mark is the current
 * one of the sandbox's interface; this deletes what a live update no longer
 * allows (`list` and `delete`) and the flows of sandboxes that are gone
 * (`sweep`), so dead entries neither fill the table nor meet a new flow of
 * the slot's next sandbox.
 *
 * A session: one request per line on stdin, answered on stdout by `entry`
 * lines (for `list`) and then one `ok N` or `error MESSAGE` line.
 *
 *   list MARK               the entries with this mark, one line each:
 *                           `entry FAMILY PROTO SRC DST DPORT|- KEY` → ok <listed>
 *   delete KEY...           delete entries `list` gave (one already gone is
 *                           not an error)                           → ok <deleted>
 *   sweep VALUE MASK CIDR... -- KEEP...
 *                           delete every entry whose mark & MASK is VALUE,
 *                           whose original source or destination lies in a
 *                           CIDR, and whose mark is none of the KEEP marks
 *                                                                   → ok <deleted>
 *
 * Both dump with the kernel filtering on the mark (CTA_MARK, CTA_MARK_MASK),
 * so the kernel walks its table once per request and sends only the matching
 * entries (the walk is the cost: ≈ 11 ms of kernel time for 262,144 buckets
 * on a busy 2-core host, whatever the number of entries); every entry is
 * checked again here before anything is deleted. A delete names the entry's
 * original tuple, zone and ID as the kernel gave them, so a newer entry with
 * the same tuple is never deleted by mistake. Marks are decimal or 0x-hex.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <linux/netfilter/nfnetlink.h>
#include <linux/netfilter/nfnetlink_conntrack.h>
#include <linux/netlink.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "cmds.h"

#define MAX_LINE (16u << 20)
#define MAX_KEY 256
#define MAX_CIDRS 8

struct addr {
    int family; /* AF_INET or AF_INET6 */
    unsigned char bytes[16];
};

struct cidr {
    struct addr a;
    int prefix;
};

/* What one dumped entry says, and what deleting it takes. */
struct entry {
    int proto;
    struct addr src, dst;
    int dport; /* -1: the protocol has no ports (ICMP and others) */
    uint32_t mark;
    unsigned char key[MAX_KEY]; /* CTA_TUPLE_ORIG, CTA_ZONE, CTA_ID as the kernel sent them */
    size_t keylen;
};

struct nl {
    int fd;
    unsigned seq;
};

static int nl_open(struct nl *nl)
{
    nl->fd = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_NETFILTER);
    nl->seq = 0;
    if (nl->fd < 0)
        return -errno;
    struct sockaddr_nl local = { .nl_family = AF_NETLINK };
    if (bind(nl->fd, (struct sockaddr *)&local, sizeof local) < 0)
        return -errno;
    return 0;
}

struct msg {
    unsigned char data[512] __attribute__((aligned(NLMSG_ALIGNTO)));
    size_t len;
};

static void msg_begin(struct msg *m, int type, int flags, int family, unsigned seq)
{
    memset(m, 0, sizeof *m);
    struct nlmsghdr *h = (struct nlmsghdr *)m->data;
    h->nlmsg_type = (uint16_t)((NFNL_SUBSYS_CTNETLINK << 8) | type);
    h->nlmsg_flags = (uint16_t)(NLM_F_REQUEST | flags);
    h->nlmsg_seq = seq;
    struct nfgenmsg *g = NLMSG_DATA(h);
    g->nfgen_family = (uint8_t)family;
    g->version = NFNETLINK_V0;
    m->len = NLMSG_LENGTH(sizeof *g);
    h->nlmsg_len = (uint32_t)m->len;
}

/* Appends raw bytes (already attributes) to the message; -E2BIG if they do not fit. */
static int msg_put(struct msg *m, const void *data, size_t len)
{
    size_t at = NLMSG_ALIGN(m->len);
    if (at + len > sizeof m->data)
        return -E2BIG;
    memcpy(m->data + at, data, len);
    m->len = at + len;
    ((struct nlmsghdr *)m->data)->nlmsg_len = (uint32_t)m->len;
    return 0;
}

static void msg_u32(struct msg *m, int type, uint32_t value)
{
    struct {
        struct nlattr a;
        uint32_t v;
    } attr = { { .nla_len = NLA_HDRLEN + 4, .nla_type = (uint16_t)type }, value };
    msg_put(m, &attr, sizeof attr);
}

static int send_msg(struct nl *nl, struct msg *m)
{
    struct sockaddr_nl kernel = { .nl_family = AF_NETLINK };
    ssize_t n = sendto(nl->fd, m->data, m->len, 0, (struct sockaddr *)&kernel, sizeof kernel);
    return n == (ssize_t)m->len ? 0 : n < 0 ? -errno : -EIO;
}

/* The attributes of a nest (or of a message's body) by type, at most max. */
static void parse_attrs(const unsigned char *p, size_t len, const struct nlattr **tb, int max)
{
    memset(tb, 0, sizeof *tb * (size_t)(max + 1));
    while (len >= NLA_HDRLEN) {
        const struct nlattr *a = (const struct nlattr *)p;
        if (a->nla_len < NLA_HDRLEN || a->nla_len > len)
            return;
        int type = a->nla_type & NLA_TYPE_MASK;
        if (type <= max)
            tb[type] = a;
        size_t step = NLA_ALIGN(a->nla_len);
        if (step >= len)
            return;
        p += step;
        len -= step;
    }
}

static const unsigned char *attr_data(const struct nlattr *a) { return (const unsigned char *)a + NLA_HDRLEN; }
static size_t attr_len(const struct nlattr *a) { return a->nla_len - NLA_HDRLEN; }

static int addr_from(const struct nlattr *a, int family, struct addr *out)
{
    size_t want = family == AF_INET6 ? 16 : 4;
    if (!a || attr_len(a) != want)
        return -1;
    out->family = family;
    memset(out->bytes, 0, sizeof out->bytes);
    memcpy(out->bytes, attr_data(a), want);
    return 0;
}

/* Reads one dumped conntrack message into `e`; -1 if it is not one we can use. */
static int entry_from(const struct nlmsghdr *h, struct entry *e)
{
    const struct nfgenmsg *g = NLMSG_DATA(h);
    size_t hdr = NLMSG_LENGTH(NLMSG_ALIGN(sizeof *g));
    if (h->nlmsg_len < hdr)
        return -1;
    const unsigned char *body = (const unsigned char *)h + hdr;
    const struct nlattr *tb[CTA_MAX + 1], *tuple[CTA_TUPLE_MAX + 1], *ip[CTA_IP_MAX + 1],
        *proto[CTA_PROTO_MAX + 1];
    parse_attrs(body, h->nlmsg_len - hdr, tb, CTA_MAX);
    if (!tb[CTA_TUPLE_ORIG] || !tb[CTA_MARK] || attr_len(tb[CTA_MARK]) != 4)
        return -1;
    parse_attrs(attr_data(tb[CTA_TUPLE_ORIG]), attr_len(tb[CTA_TUPLE_ORIG]), tuple, CTA_TUPLE_MAX);
    if (!tuple[CTA_TUPLE_IP] || !tuple[CTA_TUPLE_PROTO])
        return -1;
    parse_attrs(attr_data(tuple[CTA_TUPLE_IP]), attr_len(tuple[CTA_TUPLE_IP]), ip, CTA_IP_MAX);
    parse_attrs(attr_data(tuple[CTA_TUPLE_PROTO]), attr_len(tuple[CTA_TUPLE_PROTO]), proto, CTA_PROTO_MAX);
    memset(e, 0, sizeof *e);
    if (g->nfgen_family == AF_INET) {
        if (addr_from(ip[CTA_IP_V4_SRC], AF_INET, &e->src) || addr_from(ip[CTA_IP_V4_DST], AF_INET, &e->dst))
            return -1;
    } else if (g->nfgen_family == AF_INET6) {
        if (addr_from(ip[CTA_IP_V6_SRC], AF_INET6, &e->src) || addr_from(ip[CTA_IP_V6_DST], AF_INET6, &e->dst))
            return -1;
    } else {
        return -1;
    }
    if (!proto[CTA_PROTO_NUM] || attr_len(proto[CTA_PROTO_NUM]) != 1)
        return -1;
    e->proto = attr_data(proto[CTA_PROTO_NUM])[0];
    e->dport = -1;
    const struct nlattr *dport = proto[CTA_PROTO_DST_PORT];
    if (dport && attr_len(dport) == 2)
        e->dport = attr_data(dport)[0] << 8 | attr_data(dport)[1];
    uint32_t mark;
    memcpy(&mark, attr_data(tb[CTA_MARK]), 4);
    e->mark = ntohl(mark);
    /* The key: the family, then the attributes a delete names the entry by. */
    e->key[0] = g->nfgen_family;
    e->keylen = 1;
    const struct nlattr *parts[] = { tb[CTA_TUPLE_ORIG], tb[CTA_ZONE], tb[CTA_ID] };
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++) {
        if (!parts[i])
            continue;
        size_t n = NLA_ALIGN(parts[i]->nla_len);
        if (e->keylen + n > sizeof e->key)
            return -1;
        memcpy(e->key + e->keylen, parts[i], parts[i]->nla_len);
        memset(e->key + e->keylen + parts[i]->nla_len, 0, n - parts[i]->nla_len);
        e->keylen += n;
    }
    return 0;
}

/* Deletes the entry a key names: 1 deleted, 0 already gone, or -errno. */
static int delete_key(struct nl *nl, const unsigned char *key, size_t keylen)
{
    if (keylen < 1 + NLA_HDRLEN || (key[0] != AF_INET && key[0] != AF_INET6))
        return -EINVAL;
    struct msg m;
    msg_begin(&m, IPCTNL_MSG_CT_DELETE, NLM_F_ACK, key[0], ++nl->seq);
    int r = msg_put(&m, key + 1, keylen - 1);
    if (r == 0)
        r = send_msg(nl, &m);
    if (r < 0)
        return r;
    unsigned char buf[4096] __attribute__((aligned(NLMSG_ALIGNTO)));
    for (;;) {
        ssize_t n = recv(nl->fd, buf, sizeof buf, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return n < 0 ? -errno : -EPIPE;
        for (struct nlmsghdr *h = (struct nlmsghdr *)buf; NLMSG_OK(h, (size_t)n); h = NLMSG_NEXT(h, n)) {
            if (h->nlmsg_type != NLMSG_ERROR || h->nlmsg_seq != nl->seq)
                continue;
            int err = ((const struct nlmsgerr *)NLMSG_DATA(h))->error;
            return err == 0 ? 1 : err == -ENOENT ? 0 : err;
        }
    }
}

static int in_cidr(const struct addr *a, const struct cidr *c)
{
    if (a->family != c->a.family)
        return 0;
    int full = c->prefix / 8, rest = c->prefix % 8;
    if (memcmp(a->bytes, c->a.bytes, (size_t)full) != 0)
        return 0;
    if (rest == 0)
        return 1;
    unsigned char mask = (unsigned char)(0xff << (8 - rest));
    return (a->bytes[full] & mask) == (c->a.bytes[full] & mask);
}

static int u32_cmp(const void *x, const void *y)
{
    uint32_t a = *(const uint32_t *)x, b = *(const uint32_t *)y;
    return a < b ? -1 : a > b;
}

/* What a dump does with each entry: 0 to go on, or -errno to stop the request. */
typedef int (*entry_fn)(const struct entry *e, void *ctx);

/*
 * Dumps the entries of both families whose mark & mask is value (the kernel
 * filters; so does `fn`, to be sure) and hands each one to `fn`.
 */
static int dump(struct nl *nl, uint32_t value, uint32_t mask, entry_fn fn, void *ctx)
{
    struct msg m;
    msg_begin(&m, IPCTNL_MSG_CT_GET, NLM_F_DUMP, AF_UNSPEC, ++nl->seq);
    msg_u32(&m, CTA_MARK, htonl(value));
    msg_u32(&m, CTA_MARK_MASK, htonl(mask));
    int r = send_msg(nl, &m);
    if (r < 0)
        return r;
    static unsigned char buf[1 << 16] __attribute__((aligned(NLMSG_ALIGNTO)));
    int stop = 0;
    for (;;) {
        ssize_t n = recv(nl->fd, buf, sizeof buf, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return n < 0 ? -errno : -EPIPE;
        for (struct nlmsghdr *h = (struct nlmsghdr *)buf; NLMSG_OK(h, (size_t)n); h = NLMSG_NEXT(h, n)) {
            if (h->nlmsg_seq != nl->seq)
                continue;
            if (h->nlmsg_type == NLMSG_DONE)
                return stop;
            if (h->nlmsg_type == NLMSG_ERROR) {
                int err = ((const struct nlmsgerr *)NLMSG_DATA(h))->error;
                return err ? err : stop;
            }
            struct entry e;
            /* After a failure the rest of the dump is read, not acted on. */
            if (stop == 0 && entry_from(h, &e) == 0 && (e.mark & mask) == value)
                stop = fn(&e, ctx);
        }
    }
}

static void put_hex(const unsigned char *p, size_t n)
{
    static const char digits[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        putchar(digits[p[i] >> 4]);
        putchar(digits[p[i] & 15]);
    }
}

static int list_one(const struct entry *e, void *p)
{
    long *listed = p;
    char src[INET6_ADDRSTRLEN], dst[INET6_ADDRSTRLEN];
    inet_ntop(e->src.family, e->src.bytes, src, sizeof src);
    inet_ntop(e->dst.family, e->dst.bytes, dst, sizeof dst);
    printf("entry %d %d %s %s ", e->src.family == AF_INET6 ? 6 : 4, e->proto, src, dst);
    if (e->dport >= 0)
        printf("%d ", e->dport);
    else
        printf("- ");
    put_hex(e->key, e->keylen);
    putchar('\n');
    (*listed)++;
    return 0;
}

struct sweep_ctx {
    struct nl *op;
    const struct cidr *cidrs;
    size_t ncidrs;
    const uint32_t *keep; /* sorted */
    size_t nkeep;
    long deleted;
};

static int sweep_one(const struct entry *e, void *p)
{
    struct sweep_ctx *c = p;
    int ours = 0;
    for (size_t i = 0; i < c->ncidrs && !ours; i++)
        ours = in_cidr(&e->src, &c->cidrs[i]) || in_cidr(&e->dst, &c->cidrs[i]);
    if (!ours || bsearch(&e->mark, c->keep, c->nkeep, sizeof *c->keep, u32_cmp))
        return 0;
    int r = delete_key(c->op, e->key, e->keylen);
    if (r < 0)
        return r;
    c->deleted += r;
    return 0;
}

static int parse_mark(const char *s, uint32_t *out)
{
    char *end;
    errno = 0;
    unsigned long v = strtoul(s, &end, 0);
    if (errno || *end || end == s || *s == '-' || v > 0xffffffffUL)
        return -1;
    *out = (uint32_t)v;
    return 0;
}

static int parse_cidr(char *s, struct cidr *out)
{
    char *slash = strchr(s, '/');
    if (!slash)
        return -1;
    *slash = 0;
    memset(out, 0, sizeof *out);
    if (inet_pton(AF_INET, s, out->a.bytes) == 1)
        out->a.family = AF_INET;
    else if (inet_pton(AF_INET6, s, out->a.bytes) == 1)
        out->a.family = AF_INET6;
    else
        return -1;
    char *end;
    long p = strtol(slash + 1, &end, 10);
    int max = out->a.family == AF_INET6 ? 128 : 32;
    if (*end || end == slash + 1 || p < 0 || p > max)
        return -1;
    out->prefix = (int)p;
    return 0;
}

static int hexval(int c)
{
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

/* Splits a request line into words (in place); at most max. */
static size_t split(char *line, char **words, size_t max)
{
    size_t n = 0;
    char *save = NULL;
    for (char *w = strtok_r(line, " \t", &save); w && n < max; w = strtok_r(NULL, " \t", &save))
        words[n++] = w;
    return n;
}

static int request(struct nl *dumper, struct nl *op, char **w, size_t n, char *err, size_t errlen)
{
    if (n == 2 && !strcmp(w[0], "list")) {
        uint32_t mark;
        if (parse_mark(w[1], &mark) < 0 || mark == 0) {
            snprintf(err, errlen, "not a mark: %.32s", w[1]);
            return -EINVAL;
        }
        long listed = 0;
        int r = dump(dumper, mark, 0xffffffffu, list_one, &listed);
        if (r < 0) {
            snprintf(err, errlen, "list: %s", strerror(-r));
            return r;
        }
        printf("ok %ld\n", listed);
        return 0;
    }
    if (n >= 1 && !strcmp(w[0], "delete")) {
        long deleted = 0;
        for (size_t i = 1; i < n; i++) {
            size_t len = strlen(w[i]);
            unsigned char key[MAX_KEY];
            if (len < 2 || len % 2 || len / 2 > sizeof key) {
                snprintf(err, errlen, "bad key");
                return -EINVAL;
            }
            for (size_t j = 0; j < len / 2; j++) {
                int hi = hexval(w[i][2 * j]), lo = hexval(w[i][2 * j + 1]);
                if (hi < 0 || lo < 0) {
                    snprintf(err, errlen, "bad key");
                    return -EINVAL;
                }
                key[j] = (unsigned char)(hi << 4 | lo);
            }
            int r = delete_key(op, key, len / 2);
            if (r < 0) {
                snprintf(err, errlen, "delete: %s", strerror(-r));
                return r;
            }
            deleted += r;
        }
        printf("ok %ld\n", deleted);
        return 0;
    }
    if (n >= 4 && !strcmp(w[0], "sweep")) {
        uint32_t value, mask;
        if (parse_mark(w[1], &value) < 0 || parse_mark(w[2], &mask) < 0 || mask == 0 || (value & ~mask)) {
            snprintf(err, errlen, "bad mark or mask");
            return -EINVAL;
        }
        size_t i = 3, ncidrs = 0;
        struct cidr cidrs[MAX_CIDRS];
        for (; i < n && strcmp(w[i], "--"); i++) {
            if (ncidrs == MAX_CIDRS || parse_cidr(w[i], &cidrs[ncidrs]) < 0) {
                snprintf(err, errlen, "bad CIDR");
                return -EINVAL;
            }
            ncidrs++;
        }
        if (ncidrs == 0) {
            snprintf(err, errlen, "sweep needs a CIDR");
            return -EINVAL;
        }
        size_t nkeep = i < n ? n - i - 1 : 0;
        uint32_t *keep = calloc(nkeep ? nkeep : 1, sizeof *keep);
        if (!keep) {
            snprintf(err, errlen, "out of memory");
            return -ENOMEM;
        }
        for (size_t k = 0; k < nkeep; k++) {
            if (parse_mark(w[i + 1 + k], &keep[k]) < 0) {
                free(keep);
                snprintf(err, errlen, "not a mark: %.32s", w[i + 1 + k]);
                return -EINVAL;
            }
        }
        qsort(keep, nkeep, sizeof *keep, u32_cmp);
        struct sweep_ctx c = { .op = op, .cidrs = cidrs, .ncidrs = ncidrs, .keep = keep, .nkeep = nkeep };
        int r = dump(dumper, value, mask, sweep_one, &c);
        free(keep);
        if (r < 0) {
            snprintf(err, errlen, "sweep: %s", strerror(-r));
            return r;
        }
        printf("ok %ld\n", c.deleted);
        return 0;
    }
    snprintf(err, errlen, "unknown request %.32s", n > 0 ? w[0] : "");
    return -EINVAL;
}

int cmd_conntrack(int argc, char **argv)
{
    (void)argv;
    if (argc != 0) {
        fprintf(stderr, "usage: dsec-helper conntrack   (requests on stdin, see conntrack.c)\n");
        return 2;
    }
    struct nl dumper, op;
    int r = nl_open(&dumper);
    if (r == 0)
        r = nl_open(&op);
    if (r < 0) {
        fprintf(stderr, "dsec-helper: conntrack: netlink socket: %s\n", strerror(-r));
        return 1;
    }
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    /* stdout is a pipe (fully buffered): each answer goes out whole once its request is done. */
    while ((len = getline(&line, &cap, stdin)) >= 0) {
        if (len > 0 && line[len - 1] == '\n')
            line[--len] = 0;
        char err[256] = "";
        char **words = (size_t)len <= MAX_LINE ? malloc(((size_t)len / 2 + 2) * sizeof *words) : NULL;
        if (!words) {
            printf("error %s\n", (size_t)len > MAX_LINE ? "request too long" : "out of memory");
        } else {
            size_t n = split(line, words, (size_t)len / 2 + 2);
            if (request(&dumper, &op, words, n, err, sizeof err) < 0)
                printf("error %s\n", err);
            free(words);
        }
        if (fflush(stdout) != 0)
            break;
    }
    free(line);
    return 0;
}
