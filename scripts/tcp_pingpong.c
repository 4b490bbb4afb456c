/* The raw TCP round trip on this host, for scripts/compare-peers.sh: two
 * processes on loopback, TCP_NODELAY, blocking read and write of `size`
 * bytes each way, as the limit a TCP transport can reach. Prints one JSON
 * line in chorus-perf's --json schema (op ping_pong, half the round trip,
 * as chorus-perf reports it), system "tcp-raw".
 *
 * With a third argument `stream`, it measures one stream's bandwidth
 * instead: the parent writes `iters` messages of `size` bytes back to back,
 * the child reads them all and answers one byte at the end; reported as op
 * send_recv (time per message), the limit of a one-way transfer.
 *
 *   cc -O2 -o tcp_pingpong scripts/tcp_pingpong.c && ./tcp_pingpong 8 20000
 *   ./tcp_pingpong 16777216 50 stream
 */
#include <arpa/inet.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void full(int s, char *b, size_t n, int rd) {
  while (n > 0) {
    ssize_t k = rd ? read(s, b, n) : write(s, b, n);
    if (k <= 0) exit(1);
    b += k;
    n -= (size_t)k;
  }
}

/* One JSON line for `op`: `secs` per message of `size` bytes. */
static void report(const char *op, size_t size, double secs) {
  double algbw = size / secs / 1e9;
  printf("{\"system\":\"tcp-raw\",\"op\":\"%s\",\"nranks\":2,\"size\":%zu,\"count\":%zu,"
         "\"type\":\"float\",\"in_place\":{\"time_us\":%.3f,\"algbw_gbs\":%.4f,\"busbw_gbs\":%.4f}}\n",
         op, size, size / 4, secs * 1e6, algbw, algbw);
}

int main(int argc, char **argv) {
  size_t size = argc > 1 ? strtoul(argv[1], 0, 10) : 8;
  int iters = argc > 2 ? atoi(argv[2]) : 20000;
  int stream = argc > 3 && strcmp(argv[3], "stream") == 0;
  char *buf = calloc(size ? size : 1, 1);
  int one = 1, l = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {0};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (!buf || l < 0 || bind(l, (void *)&a, sizeof a) || listen(l, 1) ||
      getsockname(l, (void *)&a, &len))
    return 1;
  pid_t child = fork();
  if (child == 0) {
    int s = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(s, (void *)&a, sizeof a)) return 1;
    setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (stream) {
      for (int i = 0; i < iters / 10 + 1 + iters; i++) full(s, buf, size, 1);
      full(s, buf, 1, 0);
      return 0;
    }
    for (;;) {
      ssize_t k = read(s, buf, 1);
      if (k <= 0) return 0;
      if (size > 1) full(s, buf + 1, size - 1, 1);
      full(s, buf, size, 0);
    }
  }
  int s = accept(l, 0, 0);
  setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  if (stream) {
    for (int i = 0; i < iters / 10 + 1; i++) full(s, buf, size, 0);
    double t0 = now();
    for (int i = 0; i < iters; i++) full(s, buf, size, 0);
    full(s, buf, 1, 1);
    double per = (now() - t0) / iters;
    close(s);
    waitpid(child, 0, 0);
    report("send_recv", size, per);
    return 0;
  }
  for (int i = 0; i < iters / 10 + 1; i++) {
    full(s, buf, size, 0);
    full(s, buf, size, 1);
  }
  double t0 = now();
  for (int i = 0; i < iters; i++) {
    full(s, buf, size, 0);
    full(s, buf, size, 1);
  }
  double half = (now() - t0) / iters / 2;
  close(s);
  waitpid(child, 0, 0);
  report("ping_pong", size, half);
  return 0;
}
