#include <stdio.h>
#include "rotate.h"

int main(void) {
  int c;
  while ((c = getchar()) != EOF) putchar(rotate13(c));
  return 0;
}
