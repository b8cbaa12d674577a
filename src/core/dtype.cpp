// TEMPORARY STUB (replaced by the real conversions)
#include "attnkit/dtype.h"
#include "attnkit/error.h"
#include <cstring>
namespace attnkit {
size_t dtype_size(DType d){switch(d){case DType::float32: case DType::int32: return 4; case DType::float16: case DType::bfloat16: return 2; default: return 1;}}
const char* dtype_name(DType d){const char* n[]={"float32","float16","bfloat16","float8_e4m3fn","float8_e5m2","int8","uint8","int32","bool"};return n[int(d)];}
DType dtype_from_name(const std::string& s){for(int i=0;i<9;++i) if(s==dtype_name(DType(i))) return DType(i); throw Error("unknown dtype "+s);}
float float16_to_float(uint16_t h){_Float16 f; memcpy(&f,&h,2); return (float)f;}
uint16_t float_to_float16(float x){_Float16 h=(_Float16)x; uint16_t b; memcpy(&b,&h,2); return b;}
float bfloat16_to_float(uint16_t b){uint32_t u=uint32_t(b)<<16; float f; memcpy(&f,&u,4); return f;}
uint16_t float_to_bfloat16(float x){uint32_t u; memcpy(&u,&x,4); if(x!=x) return 0x7fc0; u += 0x7fff + ((u>>16)&1); return u>>16;}
float float8_e4m3fn_to_float(uint8_t){return 0;} uint8_t float_to_float8_e4m3fn(float){return 0;}
float float8_e5m2_to_float(uint8_t){return 0;} uint8_t float_to_float8_e5m2(float){return 0;}
void cast(const void*, DType, void*, DType, size_t){throw Error("stub");}
}
