#include "rotate.h"

int rotate13(int c) {
  if (c >= 'a' && c <= 'z') return 'a' + (c - 'a' + 13) % 26;
  if (c >= 'A' && c <= 'Z') return 'A' + (c - 'A' + 13) % 26;
  return c;
}
