/* Thread cancellation held off while a thread holds any of our locks or
 * waits in the runtime for us (hook.h's npa_cancel_off): the state each
 * thread had before its outermost hold, and how deep it is. */
#include "hook.h"

NPA_TLS unsigned npa_cancel_depth;
NPA_TLS int npa_cancel_saved;
