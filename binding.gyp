{
  "targets": [
    {
      "target_name": "treepack",
      "sources": ["native/core/forest.cc", "native/core/mask.cc", "native/core/loss.cc", "native/core/check.cc", "native/napi/binding.cc", "native/napi/mask_binding.cc", "native/napi/loss_binding.cc"],
      "include_dirs": ["<!(node -p \"require('node-addon-api').include_dir\")"],
      "defines": ["NAPI_VERSION=8", "NAPI_DISABLE_CPP_EXCEPTIONS"],
      "cflags_cc!": ["-std=gnu++17"],
      "cflags_cc": ["-O3", "-std=c++17", "-fvisibility=hidden"],
      "xcode_settings": {
        "CLANG_CXX_LANGUAGE_STANDARD": "c++17",
        "GCC_OPTIMIZATION_LEVEL": "3",
        "GCC_SYMBOLS_PRIVATE_EXTERN": "YES"
      },
      "msvs_settings": {
        "VCCLCompilerTool": { "AdditionalOptions": ["/std:c++17"] }
      }
    },
    {
      "target_name": "treepack_core",
      "type": "shared_library",
      "product_prefix": "lib",
      "sources": ["native/core/forest.cc", "native/core/mask.cc", "native/core/loss.cc", "native/core/check.cc"],
      "cflags_cc!": ["-std=gnu++17"],
      "cflags_cc": ["-O3", "-std=c++17", "-fvisibility=hidden"],
      "xcode_settings": {
        "CLANG_CXX_LANGUAGE_STANDARD": "c++17",
        "GCC_OPTIMIZATION_LEVEL": "3",
        "GCC_SYMBOLS_PRIVATE_EXTERN": "YES"
      },
      "msvs_settings": {
        "VCCLCompilerTool": { "AdditionalOptions": ["/std:c++17"] }
      }
    }
  ]
}
