/* The fuzz targets' reader of their input: bytes taken one at a time, zeros once the input is used up. */
#ifndef CDL_FUZZ_INPUT_H
#define CDL_FUZZ_INPUT_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    const uint8_t *data;
    size_t size;
} cdl_input;

static inline uint8_t take_byte(cdl_input *in)
{
    if (in->size == 0)
        return 0;
    in->size--;
    return *in->data++;
}

#endif
