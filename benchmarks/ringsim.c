// #60's synthetic (docs/performance.md, "Where the cores go, third look"): does a rank made of threads that
// hand work to each other over a futex earn more of a busy machine than one thread a rank?
//   gcc -O2 -pthread -o /tmp/ringsim benchmarks/ringsim.c && setsid -w /tmp/ringsim 4 0 4   # 4 ranks, one thread, 4 s
//   args: ranks, mode (0 one thread, 1 two threads), seconds, bytes a chunk (262144)
// A synthetic ring: N processes, each step every rank sends a chunk right, receives one from the
// left and folds it (float add). mode 0: one thread a rank (poll loop, nonblocking); mode 1: a
// receiving thread hands chunks to the folding+sending thread over a condition variable (futex).
// Prints steps/s and the group's CPU (cores) over T seconds.
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static size_t S;  // floats a chunk
static double T;
static int L, R;  // left (recv), right (send) fds
static volatile long *counter;

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}
static void fold(float *a, const float *b) {
  for (size_t i = 0; i < S; i++) a[i] += b[i] * 0.5f;
}

static long run_one(float *acc, float *tmp) {
  fcntl(L, F_SETFL, O_NONBLOCK);
  fcntl(R, F_SETFL, O_NONBLOCK);
  long steps = 0;
  size_t nb = S * sizeof(float);
  for (;;) {
    size_t sent = 0, got = 0;
    while (sent < nb || got < nb) {
      struct pollfd p[2] = {{L, POLLIN, 0}, {R, POLLOUT, 0}};
      p[0].fd = got < nb ? L : -1;
      p[1].fd = sent < nb ? R : -1;
      poll(p, 2, 1000);
      if (got < nb) {
        ssize_t k = read(L, (char *)tmp + got, nb - got);
        if (k > 0) got += k;
      }
      if (sent < nb) {
        ssize_t k = write(R, (char *)acc + sent, nb - sent);
        if (k > 0) sent += k;
      }
    }
    fold(acc, tmp);
    steps++;
    *counter = steps;
  }
  return steps;
}

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static long received = 0, folded = 0;
static volatile int done = 0;
static float *slots[2];


static void *receiver(void *arg) {
  (void)arg;
  size_t nb = S * sizeof(float);
  for (long i = 0; !done; i++) {
    pthread_mutex_lock(&mu);
    while (received - folded >= 2 && !done) pthread_cond_wait(&cv, &mu);
    pthread_mutex_unlock(&mu);
    size_t got = 0;
    while (got < nb) {
      ssize_t k = read(L, (char *)slots[i & 1] + got, nb - got);
      if (k <= 0) return NULL;
      got += k;
    }
    pthread_mutex_lock(&mu);
    received++;
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
  }
  return NULL;
}

static long run_two(float *acc) {
  size_t nb = S * sizeof(float);
  slots[0] = malloc(nb);
  slots[1] = malloc(nb);
  pthread_t th;
  pthread_create(&th, NULL, receiver, NULL);
  long steps = 0;
  for (;;) {
    size_t sent = 0;
    while (sent < nb) {
      ssize_t k = write(R, (char *)acc + sent, nb - sent);
      if (k > 0) sent += k;
    }
    pthread_mutex_lock(&mu);
    while (received <= folded) pthread_cond_wait(&cv, &mu);
    pthread_mutex_unlock(&mu);
    fold(acc, slots[folded & 1]);
    pthread_mutex_lock(&mu);
    folded++;
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
    steps++;
    *counter = steps;
  }
  done = 1;
  // keep the ring flowing until the neighbours stop: send a few more chunks
  return steps;
}

int main(int argc, char **argv) {
  int n = argc > 1 ? atoi(argv[1]) : 4;
  int mode = argc > 2 ? atoi(argv[2]) : 0;
  T = argc > 3 ? atof(argv[3]) : 4;
  S = (argc > 4 ? atol(argv[4]) : 262144) / sizeof(float);
  volatile long *counters = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  int sp[64][2];
  pid_t pids[64];
  for (int i = 0; i < n; i++) socketpair(AF_UNIX, SOCK_STREAM, 0, sp[i]);  // sp[i]: rank i -> rank i+1
  double t0 = now();
  for (int r = 0; r < n; r++) {
    if ((pids[r] = fork()) == 0) {
      counter = &counters[r * 8];
      R = sp[r][0];
      L = sp[(r + n - 1) % n][1];
      float *acc = calloc(S, sizeof(float)), *tmp = calloc(S, sizeof(float));
      if (mode) run_two(acc); else run_one(acc, tmp);
      _exit(0);
    }
  }
  usleep(500000);
  long a = 0, b = 0;
  for (int r = 0; r < n; r++) a += counters[r * 8];
  double ta = now();
  usleep((useconds_t)(T * 1e6));
  for (int r = 0; r < n; r++) b += counters[r * 8];
  double tb = now();
  for (int r = 0; r < n; r++) kill(pids[r], SIGKILL);
  while (wait(NULL) > 0) {}
  double el = now() - t0;
  struct rusage ru;
  getrusage(RUSAGE_CHILDREN, &ru);
  double cpu = ru.ru_utime.tv_sec + ru.ru_utime.tv_usec * 1e-6 + ru.ru_stime.tv_sec + ru.ru_stime.tv_usec * 1e-6;
  printf("n=%d mode=%s steps/s=%.0f cpu=%.2f cores\n", n, mode ? "two-threads" : "one-thread",
         (b - a) / (double)n / (tb - ta), cpu / el);
  return 0;
}
