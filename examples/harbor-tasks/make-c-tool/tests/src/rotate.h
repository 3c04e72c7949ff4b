#ifndef ROTATE_H
#define ROTATE_H
int rotate13(int c);
#endif
