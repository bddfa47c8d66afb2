/* The protocol's test vector files, concatenated by the Makefile, linked as read-only data. */
    .section .rodata.qs_vector_text, "a"
    .global qs_vector_text
    .global qs_vector_text_end
qs_vector_text:
    .incbin "vectors.txt"
qs_vector_text_end:
    .byte 0
